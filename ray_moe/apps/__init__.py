"""Scenarios and tools built on the runtime's public API; nothing in the runtime imports this package.

    release_client.py   ReleaseClient: typed calls to a deployment's coordinator for candidates, shard
                        faults and the release registry (stage, promote, fence, activate, retire, inject)
    drill/              the rollback drill (``ray-moe drill rollback``): a release promoted, faulted and
                        rolled back under live traffic, every served output checked against the reference
    server.py           ``ray-moe serve``: OpenAI-compatible completions over Ray Serve

Code here may use ``ray_moe.runtime``, the coordinator's remote methods (through ``ReleaseClient``) and the
test oracles of ``ray_moe_dev.testing``; the runtime, the actors and the pure packages (``placement``,
``dispatch``, ``phases``, ``release``, ...) never import it.
"""
