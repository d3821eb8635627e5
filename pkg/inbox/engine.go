package inbox

import (
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"
)

// ParkGrace is how long after a retrying head was due back its group stays
// parked: it covers the time the head then waits in a backlogged queue, and
// bounds how long the group's later events wait if the head is lost (a
// purged delay queue). After it they go ahead.
const ParkGrace = 15 * time.Minute

// Defaults of ConsumerConfig.
const (
	DefaultHandlerTimeout = 30 * time.Second
	DefaultMaxBatch       = 16
)

// ConsumerConfig is what every transport's consumer (a long-running runner
// or a Lambda handler) takes from its caller; the transport adds what it
// knows (lanes, retry policy) in EngineConfig.
type ConsumerConfig struct {
	// Consumer is the consumer's name, its inbox key. Required.
	Consumer string
	// Inbox is the table the consumer dedupes through; the zero Table is
	// fifobox's inbox (FIFOBOX_INBOX_TABLE, TableFromEnv).
	Inbox Table
	// Order: OrderStrict (default) holds a group behind a dead-lettered
	// event until redrive or release; OrderRelaxed lets it continue.
	Order Order
	// HandlerTimeout bounds applying one event, and committing a batch.
	// A side effect that runs out of it has failed (transiently). Default 30s.
	HandlerTimeout time.Duration
	// MaxBatch is the most events a lane applies in one transaction (a
	// savepoint each): the lane's events already waiting when it gets to
	// them, so batches form only under load and add no delay. Default 16;
	// 1 applies each event in a transaction of its own.
	MaxBatch int
	// DeadlineMargin (Lambda handlers): no event is started once the
	// invocation's deadline is this close; those not started go back to the
	// broker, behind nothing newer of their group, without counting a
	// failure. Default DefaultDeadlineMargin.
	DeadlineMargin time.Duration
	// LogAggregateIDs adds group (aggregate) ids to log lines
	// (FIFOBOX_LOG_AGGREGATE_IDS); off by default because they may carry
	// personal data.
	LogAggregateIDs bool
	// Logger; default slog.Default().
	Logger *slog.Logger
	// OnSettle, if set, is called after each record is settled (metrics,
	// tests). Calls come from the lanes, concurrently.
	OnSettle func(Settlement)
}

// EngineConfig configures an Engine: the caller's ConsumerConfig and what
// the transport knows about its broker.
type EngineConfig struct {
	ConsumerConfig
	// Lanes is how many groups are applied at once. Default 8.
	Lanes int
	// MaxRetries is how many times an event that fails transiently is
	// retried before it is dead-lettered (0: at its first failure).
	MaxRetries int
	// RetryDelay is the wait before retry n (1-based). Required if
	// MaxRetries > 0.
	RetryDelay func(n int) time.Duration
	// HoldDeferred keeps a record that waits behind its group's retrying
	// head in memory (kept alive through Keeper) until the head settles,
	// instead of handing it to Broker.Retry: for brokers that redeliver the
	// head by themselves while delivering later messages (JetStream).
	HoldDeferred bool
	// OrderedRedelivery says the broker itself keeps a group's later
	// messages back while one is being retried (SQS FIFO): records not
	// started before a deadline are handed to Broker.Retry without parking
	// their groups, so that needs no database.
	OrderedRedelivery bool
	// ParkGrace: see ParkGrace (the default).
	ParkGrace time.Duration
	// InfraRetryMax caps the wait between attempts of a batch whose
	// database work failed (100ms doubling). Default 5s.
	InfraRetryMax time.Duration
}

// Engine is the consumer engine every transport feeds: per-group lanes, a
// lane's waiting records applied in one inbox transaction with a savepoint
// each, the settlement decided once per record and carried out through the
// transport's Broker after the commit, durable holds (inbox_held) in strict
// order and durable retry parking (inbox_parked) in both orders.
//
// Failures are counted per event, durably: an event's side effect failing
// (or panicking, or running out of HandlerTimeout) is a failure; a database
// that cannot be reached, a failed commit or a lost broker connection is
// not. The engine retries such a batch in place, holding its records (and
// keeping them alive through Keeper) until the database answers, so an
// outage of any length spends no retry budget and dead-letters nothing. A
// consumer that died is an event's failure only if that event ran alone
// (a redelivered record runs alone, after a committed charge: run.go).
//
// MaxRetries is the event's own budget; the broker's delivery limit
// (SQS maxReceiveCount, JetStream max_deliver, a quorum queue's
// delivery-limit) is a backstop far above it (topology.Consumer).
type Engine struct {
	db      DB
	apply   Apply
	cfg     EngineConfig
	log     *slog.Logger
	claimer *claimer
	// noUnclaim: deleting a claim was refused (an inbox table without
	// DELETE for this user), so batches with a deadline go the careful way.
	noUnclaim atomic.Bool
}

func (c *EngineConfig) setDefaults() {
	if c.HandlerTimeout == 0 {
		c.HandlerTimeout = DefaultHandlerTimeout
	}
	if c.MaxBatch == 0 {
		c.MaxBatch = DefaultMaxBatch
	}
	if c.DeadlineMargin == 0 {
		c.DeadlineMargin = DefaultDeadlineMargin
	}
	if c.Lanes == 0 {
		c.Lanes = 8
	}
	if c.ParkGrace == 0 {
		c.ParkGrace = ParkGrace
	}
	if c.InfraRetryMax == 0 {
		c.InfraRetryMax = 5 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports the first invalid field.
func (c *EngineConfig) Validate() error {
	switch {
	case c.Consumer == "":
		return errors.New("Consumer is required")
	case c.Order != OrderStrict && c.Order != OrderRelaxed:
		return fmt.Errorf("Order %d: want OrderStrict or OrderRelaxed", c.Order)
	case c.HandlerTimeout < 0:
		return errors.New("HandlerTimeout must not be negative")
	case c.MaxBatch < 0:
		return errors.New("MaxBatch must not be negative")
	case c.DeadlineMargin < 0:
		return errors.New("DeadlineMargin must not be negative")
	case c.Lanes < 0 || c.Lanes > 1000:
		return fmt.Errorf("Lanes %d: must be 1-1000", c.Lanes)
	case c.MaxRetries < 0:
		return errors.New("MaxRetries must not be negative")
	case c.MaxRetries > 0 && c.RetryDelay == nil:
		return errors.New("RetryDelay is required when MaxRetries > 0")
	case c.ParkGrace < 0 || c.InfraRetryMax < 0:
		return errors.New("ParkGrace and InfraRetryMax must not be negative")
	}
	return nil
}

// NewEngine returns an engine applying events with apply through the inbox
// in db.
func NewEngine(db DB, apply Apply, cfg EngineConfig) (*Engine, error) {
	switch {
	case db == nil:
		return nil, errors.New("new inbox engine: db is nil")
	case apply == nil:
		return nil, errors.New("new inbox engine: apply is nil")
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("new inbox engine: %w", err)
	}
	c, err := cfg.Inbox.compile()
	if err != nil {
		return nil, fmt.Errorf("new inbox engine: Inbox: %w", err)
	}
	return &Engine{db: db, apply: apply, cfg: cfg, log: cfg.Logger, claimer: c}, nil
}

// Config is the engine's configuration with defaults applied.
func (e *Engine) Config() EngineConfig { return e.cfg }

// delay is the wait before retry n.
func (e *Engine) delay(n int) time.Duration {
	if e.cfg.RetryDelay == nil || n < 1 {
		return 0
	}
	return e.cfg.RetryDelay(n)
}

// groupAttrs names a record in log lines.
func (e *Engine) attrs(r *Record, more ...any) []any {
	a := []any{"consumer", e.cfg.Consumer, "record_id", r.ID}
	if r.decodeErr == nil {
		a = append(a, "event_id", r.env.ID, "sequence", r.env.Sequence)
	}
	if e.cfg.LogAggregateIDs && r.group != "" {
		a = append(a, "group", r.group)
	}
	return append(a, more...)
}
