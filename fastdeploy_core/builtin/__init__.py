"""What the core ships as a plugin of its own: ``plugin.py`` holds its hook implementations (the
cpu device, the built-in quantizers, the core CLI commands), registered like any third-party
plugin under the name ``builtin``; ``cpu/`` is the cpu device's room."""
