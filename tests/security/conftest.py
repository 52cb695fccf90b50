"""Attack tests: hostile peers against each layer; each test file brings its own fixtures."""
