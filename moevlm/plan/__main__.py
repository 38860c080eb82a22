"""`python -m moevlm.plan`: the planner's command line (moevlm.plan.cli)."""

import sys

from moevlm.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
