import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while Python is still importing the command line
    print("mlx-voicechat: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
