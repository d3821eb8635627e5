// Package inbox makes consumers apply each event's side effect exactly once,
// whatever the transport delivered it; it imports no broker or AWS package.
//
// Process claims (consumer, event id) in the inbox table and runs the side
// effect in the same transaction: a duplicate delivery (redelivery, redrive,
// replay) finds the claim and commits nothing; a failure rolls back both.
// Batch applies several events in one transaction, a savepoint each.
//
// Engine is the consumer engine every transport feeds (SNS/SQS, RabbitMQ /
// Amazon MQ, NATS JetStream): the transport submits transport-neutral
// Records to a Session (a runner's connection, or Handle for one Lambda
// invocation) and implements Broker (acknowledge, retry later, dead-letter)
// and, where its broker redelivers unacknowledged work, Keeper. The engine
// applies each group's records in order on per-group lanes, a lane's
// waiting records in one transaction (engine.go, run.go): the fast way
// (fast.go) when nothing in the batch needs accounting for, every claim in
// one statement and no savepoints, and otherwise, or as soon as a side
// effect fails, the careful way, a savepoint each; it decides each
// settlement once and carries it out after the commit; it parks a group behind a retrying event (inbox_parked: the
// head and its failure count, surviving restarts), in strict order holds a
// group behind a dead-lettered event (inbox_held) until redrive or
// release, waits out database failures in place without spending any
// retry budget, runs a redelivered record alone after a committed charge
// (so a consumer that dies is charged to an event only when that event ran
// alone: a crash loop spends no healthy event's budget, an event that kills
// its consumer is dead-lettered after MaxRetries), and stops starting
// records DeadlineMargin before a Lambda deadline, handing back only what
// it did not finish.
package inbox
