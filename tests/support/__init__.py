"""What the tests share that is not a test: helpers, stand-ins and plug-ins.

Test modules import these from here, never from one another. The plug-ins (`faults`,
`slow_model`, `stagefns`) are also loaded by reference (`tests.support.faults:...`)
by daemons and stage processes the tests start.
"""
