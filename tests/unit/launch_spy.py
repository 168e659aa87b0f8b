"""A stand-in for a Triton kernel that counts its launches (tests of how many launches a dispatch makes)."""


class LaunchSpy:
    """Counts launches of a Triton kernel (``kernel[grid](...)``) and forwards them to it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]
