"""The package's version, in a module of its own: the modules that stamp it on what they write (reports,
trained models) import it from here, not from the package root, whose ``load`` reaches the runtime."""

__version__ = "0.1.0"
