import sys

from hpc_train.cli.main import main

sys.exit(main())
