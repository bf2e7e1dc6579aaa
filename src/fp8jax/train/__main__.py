import sys

from ._cli import console_main

sys.exit(console_main())
