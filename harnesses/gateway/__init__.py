from harnesses.gateway.server import *  # noqa: F403
from harnesses.gateway.server import __doc__  # noqa: F401
