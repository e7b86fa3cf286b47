import sys

from simulator.cli.main import main

sys.exit(main())
