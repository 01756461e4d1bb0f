"""What the two torchtitan test files share."""


def integration():
    """``moonep.integrations.torchtitan``, imported by the test that runs it, not by pytest collecting every file
    (torchtitan takes 3.5 s to import). On 3.11+ a missing install fails the test: no skip."""
    from moonep.integrations import torchtitan  # heavy: torchtitan imports its attention kernels (triton)

    return torchtitan
