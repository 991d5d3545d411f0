"""The command-line entry points (``blockd``, ``blockctl``): the top layer, above ``target/`` and
``initiator/``, which the rest of ``blockd/`` sits below."""
