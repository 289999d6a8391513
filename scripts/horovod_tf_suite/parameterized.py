"""Minimal stand-in for the `parameterized` package (expand only), for the by-hand run."""
import functools


class parameterized:
    @staticmethod
    def expand(cases):
        def deco(fn):
            import inspect
            frame = inspect.currentframe().f_back
            for i, case in enumerate(cases):
                args = case if isinstance(case, tuple) else (case,)
                def make(args=args):
                    @functools.wraps(fn)
                    def t(self):
                        return fn(self, *args)
                    return t
                frame.f_locals[f"{fn.__name__}_{i}"] = make()
            return None
        return deco
