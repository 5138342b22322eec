import sys

from anatomist.cli import main

sys.exit(main())
