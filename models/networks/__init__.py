"""The networks: MobileNetV2 backbone, margin heads, the DFC branch, the face model around them, teachers, and
their weights and ONNX export. Importing this package imports no torch; its modules do (but `face_weights`)."""
