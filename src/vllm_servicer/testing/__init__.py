"""For tests of code that serves or calls this package: tiny models and stand-in engines."""
