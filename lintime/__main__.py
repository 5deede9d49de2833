import sys

from lintime.cli import main

sys.exit(main())
