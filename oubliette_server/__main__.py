import sys

from .program.entry import main

sys.exit(main())
