import sys

from grpo_stream.cli import main

sys.exit(main())
