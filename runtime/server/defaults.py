"""The server's operational defaults, in a module free of web imports so `precast --help` stays fast."""

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # a 2,048-token prompt is ~10 KB of text or ~15 KB of token ids
DEFAULT_DRAIN_TIMEOUT = 30.0  # seconds requests in flight may run on after SIGTERM
API_KEY_ENV = "PRECAST_API_KEY"
