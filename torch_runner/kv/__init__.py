"""torch_runner.kv: KV memory: block ids and refcounts, the radix prefix cache, paged and windowed caches.
Imports no scheduler, runner, engine or serve; block_manager and radix_cache import no torch."""
