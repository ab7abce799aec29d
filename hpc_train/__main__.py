import sys

from hpc_train.cli import main

sys.exit(main())
