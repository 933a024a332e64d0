"""The services as processes on this machine, started with exactly the commands a pod runs: one engine group
(`local.LocalStack`, `minedraft up`), N groups behind a gateway, with a drafter pool or without
(`gateway.GatewayStack`, `minedraft up --engine-groups N`), and how `up` keeps them running
(`supervision.Supervisor`). The tests, the benchmarks and the offline API with tensor parallelism start
stacks too.
"""
