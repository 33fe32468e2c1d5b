import sys

from ffr.cli import main

sys.exit(main())
