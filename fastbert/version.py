"""fastbert's version, in a module of its own so that code under the package (the timing store's fingerprint) reads it
without importing the package's front door, which imports everything."""

__version__ = "0.1.0"
