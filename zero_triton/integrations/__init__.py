"""Every patch of another library, in one place. Nothing here runs at import: ``install()``
(called once by ``zero_triton/__init__``) arms them, and each is applied when the first
ZeroAdam is built. See the README's "Patches of other libraries"."""
