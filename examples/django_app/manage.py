#!/usr/bin/env python
"""OUTBOX_DSN=postgresql://app@localhost/app python manage.py migrate   (then runserver, outbox_migrate, ...)"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
