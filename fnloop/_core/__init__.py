"""The core: the state record, phases, metrics, hook combinators and the fold."""
