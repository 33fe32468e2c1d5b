"""The models' command-line code: `commands` adds `ffr train`, `ffr pretrain`, `ffr export`, ...; `common` and
`objective` hold the option builders other packages' commands share. Importing it imports no torch."""
