"""Events out: the server's job events, fanned out to outside consumers over a message bus.

- ``model``: ``Event`` (one row of the store's job events, with its sequence number), its
  routing key and JSON body, the cursor rule (pure);
- ``urls``: ``--events`` URLs (``amqp://…``, ``kafka://…``) parsed and checked (pure);
- ``sinks``: ``AmqpSink`` (RabbitMQ, pika) and ``KafkaSink`` (confluent-kafka), each publishing
  a batch and returning only once the broker confirmed every message;
- ``relay``: ``EventRelay``, one thread per sink that reads the store after its own cursor and
  publishes in order, at least once; the cursor is kept in the store.
docs/queues.md says what a consumer sees.
"""
