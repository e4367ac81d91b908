import sys

from pdserve.router.plan.cli import main

sys.exit(main())
