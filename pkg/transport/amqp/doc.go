// Package amqp is fifobox's RabbitMQ transport (RabbitMQ, or Amazon MQ for
// RabbitMQ), on the RabbitMQ team's AMQP 0-9-1 client
// (github.com/rabbitmq/amqp091-go). It implements pkg/transport's four parts:
//
//   - Publisher (outbox.Publisher): persistent messages to one exchange with
//     publisher confirms and mandatory routing; message id = event id; routing
//     key and headers from the Topology's templates. Each Publish call
//     publishes its messages on a pooled confirm channel and then waits for
//     all their confirms (one round trip per call). Outcomes: nil once
//     confirmed and routed; retryable ErrUnroutable (no queue bound),
//     ErrNacked (a queue full or failing), ErrConfirmLost (channel or
//     connection closed first), ErrUnavailable (no connection); permanent
//     ErrTooLarge and ErrRoutingKey. It reconnects on its own.
//   - Provisioner: the Topology as data, declared idempotently: the
//     exchange (topic, fanout, headers or direct), a direct dead-letter
//     exchange, and per consumer a durable queue (quorum by default, single
//     active consumer, dead-lettering to "<queue>.dlq"), its bindings, its
//     DLQ and one delay queue per retry delay.
//   - Runner (local or container consumer) and LambdaHandler (Amazon MQ
//     event source): decode, apply through the inbox, then acknowledge (a
//     lane's waiting messages in one inbox.Batch, settled in order after
//     its commit); transient
//     failures wait in a delay queue and come back (exponential backoff, a
//     retry limit, then the DLQ with the reason), and later events of the
//     same aggregate wait behind them; invalid and permanently failing
//     messages go to the DLQ at once.
//   - Operations: queue, retry and DLQ depths; DLQ redrive in order; replay
//     of stored events to one consumer.
//
// Examples of Topology for the three layouts the transport was built for:
// Holdco, Ticketing and Corewrite; FromTopology maps fifobox's own
// pkg/topology onto a headers exchange. docs/transports-rabbitmq.md has the
// whole picture.
package amqp
