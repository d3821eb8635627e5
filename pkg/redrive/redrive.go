// Package redrive holds fifobox's operator actions on a running pipeline,
// shared by the redrive Lambda and the fifobox CLI:
//
//   - requeue-dead: dead outbox rows go back to pending (attempts 0) and
//     their aggregates' heads become due now; the dispatcher then publishes
//     each aggregate's events in sequence order, the requeued one first.
//   - discard-dead: dead events that can never be published (a broker
//     rejects them for good) are given up, with a reason; their aggregates
//     resume with the events after them. Explicit event ids only.
//   - replay: sent events of one aggregate type and time range are sent again
//     to ONE consumer's queue (same body, aggregate id as message group, in
//     sequence order), after deleting that consumer's inbox entries for
//     exactly those events in the transaction that writes the audit row, so
//     only that consumer re-applies them (to rebuild a read model).
//   - dlq-redrive: messages move from a consumer's DLQ (or, on SNS, its
//     subscription's DLQ) back to its queue, keeping each aggregate's order.
//     A consumer in strict order applies a held group's messages as they
//     come back in order and then releases the group (pkg/inbox).
//   - release-holds: ends a strict-order consumer's holds (table
//     inbox_held) when the dead-lettered messages they wait for are gone
//     (purged, expired after the DLQ's 14 days, deleted by hand); the
//     group's next messages are then applied as they come.
//   - migrate, prune, and the read-only status and dead-list.
//
// Every action that changes something writes a redrive_audit row (who, what,
// parameters, when, how many, outcome) and a log line. The broker's side of
// status, replay and dlq-redrive goes through a transport.Operations, the
// same calls whatever the transport (pkg/transport/sns, amqp, nats).
package redrive

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Operations.
const (
	OpMigrate       = "migrate"
	OpStatus        = "status"
	OpDeadList      = "dead-list"
	OpRequeueDead   = "requeue-dead"
	OpDiscardDead   = "discard-dead"
	OpReplay        = "replay"
	OpDLQRedrive    = "dlq-redrive"
	OpPrune         = "prune"
	OpReleaseHolds  = "release-holds"
	defaultMax      = 100_000
	replayChunk     = 9 // events read and sent per step (SQS sends at most 10 per call)
	defaultLimit    = 100
	defaultPruneAge = 7 * 24 * time.Hour
)

// allOperations lists every operation, in the order the docs give them.
var allOperations = []string{OpMigrate, OpStatus, OpDeadList, OpRequeueDead, OpDiscardDead, OpReplay, OpDLQRedrive, OpReleaseHolds, OpPrune}

var operations = strings.Join(allOperations, ", ")

// CheckOperation reports whether op names an operation, with an error that
// lists them all if it does not.
func CheckOperation(op string) error {
	switch {
	case op == "":
		return errors.New("operation is required: one of " + operations)
	case !slices.Contains(allOperations, op):
		return fmt.Errorf("unknown operation %q: want one of %s", op, operations)
	}
	return nil
}

// Command is one operator request, the JSON the redrive Lambda is invoked
// with and the CLI builds from its flags.
type Command struct {
	// Operation is one of migrate, status, dead-list, requeue-dead,
	// discard-dead, replay, dlq-redrive, release-holds, prune.
	Operation string `json:"operation,omitempty"`
	// Actor says who asked (the CLI sends user@host); recorded in the
	// audit. Nothing verifies it: the redrive Lambda records a payload's
	// actor as ClaimedActorPrefix + actor, beside its own request id.
	Actor string `json:"actor,omitempty"`
	// RequestID correlates the audit row with the Lambda request (set by the Lambda).
	RequestID string `json:"request_id,omitempty"`
	// DryRun reports what would be done without doing it.
	DryRun bool `json:"dry_run,omitempty"`

	// EventIDs selects events by id (requeue-dead, discard-dead).
	EventIDs []string `json:"event_ids,omitempty"`
	// Reason says why dead events are discarded (discard-dead, required);
	// it is appended to each event's last error and kept in the audit.
	Reason string `json:"reason,omitempty"`
	// AggregateType, Since and Until select events by aggregate type and
	// creation time, Since inclusive, Until exclusive (requeue-dead, replay).
	AggregateType string     `json:"aggregate_type,omitempty"`
	Since         *time.Time `json:"since,omitempty"`
	Until         *time.Time `json:"until,omitempty"`
	// Consumer is the target consumer (replay, dlq-redrive; optional for status).
	Consumer string `json:"consumer,omitempty"`
	// Groups selects message groups (= aggregate ids) for release-holds;
	// empty: every held group of the consumer.
	Groups []string `json:"groups,omitempty"`
	// Source is where dlq-redrive takes messages from: "dlq" (default), the
	// consumer queue's DLQ, or "subscription-dlq", the DLQ of the
	// consumer's SNS subscription (messages SNS could not deliver).
	Source string `json:"source,omitempty"`
	// Max bounds how many events or messages the operation may touch:
	// dlq-redrive moves at most Max; requeue-dead and replay refuse a
	// selection larger than Max. Default 100,000.
	Max int `json:"max,omitempty"`
	// Limit bounds dead-list rows (default 100).
	Limit int `json:"limit,omitempty"`
	// OlderThan is prune's retention of sent outbox events, a Go duration
	// such as "168h" (default 7 days).
	OlderThan string `json:"older_than,omitempty"`
	// InboxOlderThan is prune's retention of inbox rows (default 720h, 30
	// days). Keep it longer than the DLQs' message retention (14 days at
	// most): a message redriven from a DLQ is recognised as applied only
	// while its inbox row exists.
	InboxOlderThan string `json:"inbox_older_than,omitempty"`
}

// Result is an operation's outcome (the Lambda's response; the CLI prints it).
type Result struct {
	Operation string `json:"operation,omitempty"`
	AuditID   int64  `json:"audit_id,omitempty"`
	DryRun    bool   `json:"dry_run,omitempty"`
	// Affected counts events or messages touched (or that would be, in a dry run).
	Affected int64 `json:"affected"`
	// Aggregates counts distinct aggregates touched (requeue-dead, replay).
	Aggregates int    `json:"aggregates,omitempty"`
	Message    string `json:"message,omitempty"`
	// Status and Dead are filled by status and dead-list.
	Status *Status    `json:"status,omitempty"`
	Dead   []DeadItem `json:"dead,omitempty"`
}

// dlq-redrive sources.
const (
	SourceDLQ             = string(transport.ConsumerDLQ)
	SourceSubscriptionDLQ = string(transport.SubscriptionDLQ)
)

// Config configures a Service.
type Config struct {
	// Operations are the broker side of status (queue depths), replay and
	// dlq-redrive (transport.Transport.Operations); nil: only the database
	// operations (and status without queue depths) work.
	Operations transport.Operations
	// Provisioner, when set, declares the broker's topology (idempotently)
	// after the migrations in migrate: the deploy trigger's one call leaves
	// both the database and the broker ready.
	Provisioner transport.Provisioner
	// Logger; default slog.Default().
	Logger *slog.Logger
	// Progress, if set, is called as long operations advance (done of total; total -1 if unknown).
	Progress func(op string, done, total int64)
}

// Service runs operations against one database and, through
// Config.Operations, one transport.
type Service struct {
	db  *pgxpool.Pool
	cfg Config
	log *slog.Logger
}

// New returns a Service.
func New(db *pgxpool.Pool, cfg Config) (*Service, error) {
	if db == nil {
		return nil, errors.New("new redrive service: db is nil")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Service{db: db, cfg: cfg, log: cfg.Logger}, nil
}

// Retention guards of prune. They hold for every caller: the daily
// schedule, an invocation of the redrive function, the CLI.
const (
	// MinSentRetention is the shortest older_than prune accepts: sent
	// events are what replay re-sends, and older_than 0 would delete every
	// sent event at once.
	MinSentRetention = 24 * time.Hour
	// MinInboxRetention is the shortest inbox_older_than prune accepts:
	// inbox.MinRetention, longer than any DLQ keeps a message.
	MinInboxRetention = inbox.MinRetention
)

// ClaimedActorPrefix marks an audit actor that the caller stated and nothing
// verified (the redrive Lambda cannot see who invoked it; CloudTrail's
// Invoke event can, found by the request id recorded beside it).
const ClaimedActorPrefix = "claimed:"

// maxActorLen bounds the audit's actor.
const maxActorLen = 256

// Validate checks the fields every operation shares and prune's retentions
// before anything runs, each error naming its JSON field. Execute calls it;
// the CLI calls it before invoking the redrive Lambda.
func (c Command) Validate() error {
	if err := CheckOperation(c.Operation); err != nil {
		return err
	}
	if c.Max < 0 {
		return fmt.Errorf("max %d: must be positive", c.Max)
	}
	if c.Source != "" && c.Source != SourceDLQ && c.Source != SourceSubscriptionDLQ {
		return fmt.Errorf("source %q: want %s or %s", c.Source, SourceDLQ, SourceSubscriptionDLQ)
	}
	if len(c.Actor) > maxActorLen || strings.ContainsFunc(c.Actor, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
		return fmt.Errorf("actor: at most %d characters without control characters", maxActorLen)
	}
	if c.Operation == OpDiscardDead {
		// A discarded event is never published: it is chosen event by
		// event, and why is recorded.
		if len(c.EventIDs) == 0 {
			return errors.New("event_ids: required for discard-dead (discarding is chosen event by event)")
		}
		if strings.TrimSpace(c.Reason) == "" {
			return errors.New("reason: required for discard-dead")
		}
	}
	if c.Operation == OpPrune {
		if _, err := retention("older_than", c.OlderThan, defaultPruneAge, MinSentRetention); err != nil {
			return err
		}
		if _, err := retention("inbox_older_than", c.InboxOlderThan, inbox.DefaultRetention, MinInboxRetention); err != nil {
			return err
		}
	}
	return nil
}

// Execute validates and runs one command.
func (s *Service) Execute(ctx context.Context, cmd Command) (Result, error) {
	if err := cmd.Validate(); err != nil {
		return Result{}, err
	}
	if cmd.Actor == "" {
		cmd.Actor = "unknown"
	}
	if cmd.Max == 0 {
		cmd.Max = defaultMax
	}
	var (
		res Result
		err error
	)
	switch cmd.Operation {
	case OpMigrate:
		return s.migrate(ctx, cmd)
	case OpStatus:
		return s.status(ctx, cmd)
	case OpDeadList:
		return s.deadList(ctx, cmd)
	case OpRequeueDead:
		res, err = s.requeueDead(ctx, cmd)
	case OpDiscardDead:
		res, err = s.discardDead(ctx, cmd)
	case OpReplay:
		res, err = s.replay(ctx, cmd)
	case OpDLQRedrive:
		res, err = s.dlqRedrive(ctx, cmd)
	case OpReleaseHolds:
		res, err = s.releaseHolds(ctx, cmd)
	case OpPrune:
		res, err = s.prune(ctx, cmd)
	default: // listed in allOperations but not handled here
		return Result{}, fmt.Errorf("operation %q is not implemented", cmd.Operation)
	}
	// Dry runs change nothing but are audited too: who looked at moving what.
	if err == nil && cmd.DryRun && res.AuditID == 0 {
		id, aerr := s.auditStart(ctx, s.db, cmd)
		if aerr == nil {
			aerr = s.auditFinish(ctx, id, cmd, res.Affected, nil)
			res.AuditID = id
		}
		if aerr != nil {
			return res, aerr
		}
	}
	return res, err
}

// ops returns the transport's operations for consumer's queues.
func (s *Service) ops(consumer string) (transport.Operations, error) {
	if consumer == "" {
		return nil, errors.New("consumer is required")
	}
	if s.cfg.Operations == nil {
		return nil, errors.New("no transport configured: this operation needs the broker")
	}
	return s.cfg.Operations, nil
}

func (s *Service) progress(op string, done, total int64) {
	if s.cfg.Progress != nil {
		s.cfg.Progress(op, done, total)
	}
}
