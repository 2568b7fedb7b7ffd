"""Scenarios and tools built on the runtime's public API; nothing in the runtime imports this package.

    release_client.py   ReleaseClient: typed calls to a deployment's coordinator for candidates, shard
                        faults and the release registry (stage, promote, fence, activate, retire, inject)
    drill/              the rollback drill (``ray-moe drill rollback``): a release promoted, faulted and
                        rolled back under live traffic, every served output checked against the reference
    cli.py              the ``ray-moe`` command; serve_flags.py: ``ray-moe serve``'s options (vllm serve's spellings)
    serve_run.py        a server's checks (serve_checks.py: the bind check, the device), start, state file
                        (deployments.py) and stop; connect.py: which cluster a command reaches
    server.py           ``ray-moe serve``: OpenAI-compatible completions over Ray Serve (openai_protocol.py,
                        api_errors.py, choices.py, detokenize.py, vocab.py, metrics.py)

Code here may use ``ray_moe.runtime`` and the coordinator's remote methods (through ``ReleaseClient``); the
runtime, the actors and the pure packages (``placement``,
``dispatch``, ``phases``, ``release``, ...) never import it.
"""
