__version__ = "2.3.1+cu121"
cuda = "12.1"
hip = None
git_version = "fake"
