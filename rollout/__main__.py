import sys

from rollout.cli import main

sys.exit(main())
