"""The test suite, a package so that every folder imports ``tests.helpers`` (pytest puts the repo root on
sys.path for a package)."""
