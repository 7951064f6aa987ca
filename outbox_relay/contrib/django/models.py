"""No models: the outbox tables are the package's own (sql/migrations). Django sends ``post_migrate``
only to apps that have a models module, so this empty one lets ``manage.py migrate`` migrate the outbox."""
