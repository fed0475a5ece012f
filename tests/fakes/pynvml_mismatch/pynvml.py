"""Fake pynvml whose nvmlInit fails like a driver upgraded without a reboot."""


class NVMLError(Exception):
    pass


def nvmlInit():
    raise NVMLError("Driver/library version mismatch")


def nvmlShutdown():
    pass
