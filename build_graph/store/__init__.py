"""The store: CAS, action cache and build trace. Only this package and the sandbox touch the OS."""
