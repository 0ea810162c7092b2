"""Code that runs inside the interpreter of the install under check, never in the toolchain:
stdlib only, each module passed to that interpreter as a script."""
