// Package inbox makes consumers apply each event's side effect exactly once,
// whatever the transport delivered it; it imports no broker or AWS package.
//
// Process claims (consumer, event id) in the inbox table and runs the side
// effect in the same transaction: a duplicate delivery (redelivery, redrive,
// replay) finds the claim and commits nothing; a failure rolls back both.
// Batch applies several events in one transaction, a savepoint each.
// BatchHandler applies a delivered batch of a FIFO queue's records in
// order, with FIFO-correct partial failures and, in strict order, the
// durable holds of table inbox_held; pkg/transport/sns is it over SQS
// records (the consumer Lambda's handler and its local runner).
package inbox
