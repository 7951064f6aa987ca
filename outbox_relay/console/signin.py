"""Signing in with a token of the token file (and out): a session cookie for this console's pages."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from .security import SESSION_COOKIE, SESSION_SECONDS, match_token
from .web import checked_form, console, problem, render


def _next(value: object) -> str:
    """Only a path of this console (no open redirect to another site)."""
    return value if isinstance(value, str) and value.startswith("/") and not value.startswith("//") else "/"


def signin_form(request: Request) -> Response:
    return render(request, "signin.html", title="Sign in", next=_next(request.query_params.get("next")))


async def signin(request: Request) -> Response:
    form, refused = await checked_form(request)
    if refused is not None:
        return refused
    c = console(request)
    if c.tokens is None:
        return problem(request, 403, "this console was started without --token-file: there is nothing to sign in "
                                     "with (it is read-only)")
    given = form.get("token")
    token = match_token(c.tokens, given) if isinstance(given, str) and given else None
    if token is None:
        return render(request, "signin.html", status=403, title="Sign in", next=_next(form.get("next")),
                      error="that is not a token of this console's token file")
    operator = form.get("operator")
    name = operator.strip()[:100] if isinstance(operator, str) and operator.strip() else None
    response = RedirectResponse(_next(form.get("next")), status_code=303)
    response.set_cookie(SESSION_COOKIE, c.sessions.start(token, name), max_age=int(SESSION_SECONDS), httponly=True,
                        samesite="strict", path="/")
    return response


async def signout(request: Request) -> Response:
    _form, refused = await checked_form(request)
    if refused is not None:
        return refused
    console(request).sessions.end(request.cookies.get(SESSION_COOKIE))
    response = RedirectResponse("/", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


routes = [Route("/signin", signin_form, methods=["GET"]), Route("/signin", signin, methods=["POST"]),
          Route("/signout", signout, methods=["POST"])]
