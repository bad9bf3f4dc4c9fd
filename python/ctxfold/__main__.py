import sys

from ctxfold.cli import main

sys.exit(main())
