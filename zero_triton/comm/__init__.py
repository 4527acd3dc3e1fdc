"""The communication layer: the process-group wrapper (``group``), gradient buckets
reduce-scattered as backward runs (``grads`` registers the hooks, ``buckets`` launches and
waits), parameter gathers waited by each module's forward (``prefetch``), the CUDA side
stream (``streams``) and every rank's agreement on the user's calls (``agreement``)."""
