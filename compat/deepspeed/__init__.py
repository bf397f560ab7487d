"""``import deepspeed``, answered by zerolap: the mapping lives in ``zerolap.aliases``."""

import sys

from zerolap.aliases import serve

serve(sys.modules[__name__])
