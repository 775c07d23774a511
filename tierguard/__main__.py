import sys

from tierguard.cli.main import main

sys.exit(main())
