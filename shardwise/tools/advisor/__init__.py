"""Layer 6: ``shardwise plan``, the advisor over every strategy.

The cost formulas are pure and live below the strategies (`shardwise.strategies.cost`: `model_spec`,
`cluster`, `cost`, `memory`, `bubble`). This package sits above them because it calls each
strategy's own ``plan`` for every candidate (`candidates`), runs candidates through the
`Trainer` to check the predictions (`validate`) and measures this machine with
`shardwise.launch` (`calibrate`); `recommend` applies the guide and `commands` is the command.
"""
