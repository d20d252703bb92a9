import sys

from precast.cli import main

sys.exit(main())
