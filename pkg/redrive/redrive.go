// Package redrive holds fifobox's operator actions on a running pipeline,
// shared by the redrive Lambda and the fifobox CLI. Ops (schema.go)
// declares every operation and its arguments once; the CLI's commands and
// the Lambda's JSON both come from it:
//
//   - dead-requeue: dead outbox rows go back to pending (attempts 0) and
//     their aggregates' heads become due now; the dispatcher then publishes
//     each aggregate's events in sequence order, the requeued one first.
//   - dead-discard: dead events that can never be published (a broker
//     rejects them for good) are given up, with a reason; their aggregates
//     resume with the events after them. Explicit event ids only.
//   - retry-now: aggregates backing off after a failed publish become due
//     now (once the cause is fixed).
//   - replay: sent events of one aggregate type and time range are sent again
//     to ONE consumer's queue (same body, aggregate id as message group, in
//     sequence order), after deleting that consumer's inbox entries for
//     exactly those events in the transaction that writes the audit row, so
//     only that consumer re-applies them (to rebuild a read model).
//   - redrive: messages move from a consumer's DLQ (or, on SNS, its
//     subscription's DLQ) back to its queue, keeping each aggregate's order;
//     all, or chosen groups. A consumer in strict order applies a held
//     group's messages as they come back in order and then releases the
//     group (pkg/inbox).
//   - dlq-list, dlq-peek, dlq-discard: a DLQ's messages, looked at without
//     taking them, and chosen ones deleted for good (their holds released,
//     so the group's remaining messages still apply in order).
//   - release-holds: ends a strict-order consumer's holds (table
//     inbox_held) when the dead-lettered messages they wait for are gone
//     (purged, expired after the DLQ's 14 days, deleted by hand); the
//     group's next messages are then applied as they come.
//   - migrate, prune, and the read-only status, dead-list and audit.
//
// Every action that changes something writes a redrive_audit row (who, what,
// parameters, when, how many, outcome) and a log line. The broker's side
// goes through a transport.Operations, the same calls whatever the
// transport (pkg/transport/sns, amqp, nats).
package redrive

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Operations (OpSpec.Name: the CLI's command words joined by "-").
const (
	OpMigrate      = "migrate"
	OpStatus       = "status"
	OpDeadList     = "dead-list"
	OpRequeueDead  = "dead-requeue"
	OpDiscardDead  = "dead-discard"
	OpRetryNow     = "retry-now"
	OpRepairHeads  = "repair-heads"
	OpDLQRedrive   = "redrive"
	OpDLQList      = "dlq-list"
	OpDLQPeek      = "dlq-peek"
	OpDLQDiscard   = "dlq-discard"
	OpReleaseHolds = "release-holds"
	OpReplay       = "replay"
	OpPrune        = "prune"
	OpAudit        = "audit"

	defaultMax      = 100_000
	replayChunk     = 9 // events read and sent per step (SQS sends at most 10 per call)
	defaultLimit    = 100
	defaultPruneAge = 7 * 24 * time.Hour
)

// renamed are operation names of earlier versions, for a helpful error.
var renamed = map[string]string{"dlq-redrive": OpDLQRedrive, "requeue-dead": OpRequeueDead, "discard-dead": OpDiscardDead}

// CheckOperation reports whether op names an operation, with an error that
// lists them all if it does not.
func CheckOperation(op string) error {
	names := make([]string, len(Ops))
	for i, o := range Ops {
		names[i] = o.Name
	}
	all := strings.Join(names, ", ")
	if op == "" {
		return &FieldError{Field: "operation", Err: errors.New("required: one of " + all)}
	}
	if _, ok := Spec(op); ok {
		return nil
	}
	if to, ok := renamed[op]; ok {
		return &FieldError{Field: "operation", Err: fmt.Errorf("%q is now %q (the CLI's command name)", op, to)}
	}
	return &FieldError{Field: "operation", Err: fmt.Errorf("unknown operation %q: want one of %s", op, all)}
}

// Command is one operator request: the JSON the redrive Lambda is invoked
// with and the CLI builds from its flags (DecodeCommand reads it; Ops says
// which operation takes which field). Durations are seconds in JSON, times
// RFC 3339.
type Command struct {
	// Operation is one of Ops' names.
	Operation string `json:"operation,omitempty"`
	// Actor says who asked (the CLI sends user@host); recorded in the
	// audit. Nothing verifies it: the redrive Lambda records a payload's
	// actor as ClaimedActorPrefix + actor, beside its own request id.
	Actor string `json:"actor,omitempty"`
	// RequestID correlates the audit row with the Lambda request (set by
	// the Lambda, never read from the payload).
	RequestID string `json:"-"`
	// DryRun reports what would be done without doing it.
	DryRun bool `json:"dry_run,omitempty"`

	// EventIDs selects events by id (dead-requeue, dead-discard).
	EventIDs []string `json:"event_ids,omitempty"`
	// Reason says why (dead-discard, dlq-discard: required); recorded.
	Reason string `json:"reason,omitempty"`
	// AggregateType, Since and Until select events by aggregate type and
	// creation time, Since inclusive, Until exclusive (dead-requeue,
	// replay); AggregateType and AggregateIDs select aggregates (retry-now).
	AggregateType string   `json:"aggregate_type,omitempty"`
	AggregateIDs  []string `json:"aggregate_ids,omitempty"`
	Since         *Instant `json:"since,omitempty"`
	Until         *Instant `json:"until,omitempty"`
	// Error selects retry-now's aggregates by their last publish error.
	Error string `json:"error,omitempty"`
	// Consumer is the target consumer (optional for status).
	Consumer string `json:"consumer,omitempty"`
	// Groups, Aggregates and Messages select dead-lettered messages
	// (redrive, dlq-*) by message group, "type/id" or id, and key;
	// Groups also selects release-holds' groups.
	Groups     []string `json:"groups,omitempty"`
	Aggregates []string `json:"aggregates,omitempty"`
	Messages   []string `json:"messages,omitempty"`
	// From is the dead-letter queue: "dlq" (default), the consumer queue's
	// DLQ, or "subscription-dlq", the DLQ of the consumer's SNS
	// subscription (messages SNS could not deliver).
	From string `json:"from,omitempty"`
	// Max bounds how many events or messages the operation may touch:
	// redrive and dlq-discard move or delete at most Max; the others refuse
	// a selection larger than Max. Default 100,000.
	Max int `json:"max,omitempty"`
	// Limit bounds listed rows (dead-list, dlq-list, audit; default 100, 20
	// for audit).
	Limit int `json:"limit,omitempty"`
	// OlderThan is prune's retention of sent outbox events (default 7 days).
	OlderThan Duration `json:"older_than,omitempty"`
	// InboxOlderThan is prune's retention of inbox rows (default 30 days).
	// Keep it longer than the DLQs' message retention (14 days at most): a
	// message redriven from a DLQ is recognised as applied only while its
	// inbox row exists.
	InboxOlderThan Duration `json:"inbox_older_than,omitempty"`
}

// Result is an operation's outcome (the Lambda's response; the CLI prints it).
type Result struct {
	Operation string `json:"operation"`
	AuditID   int64  `json:"audit_id,omitempty"`
	DryRun    bool   `json:"dry_run,omitempty"`
	// Affected counts events or messages touched (or that would be, in a dry run).
	Affected int64 `json:"affected"`
	// Aggregates counts distinct aggregates touched.
	Aggregates int `json:"aggregates,omitempty"`
	// Exact is false when a count may be short: the broker could not show
	// every message (see transport.PeekResult.Complete).
	Exact   *bool  `json:"exact,omitempty"`
	Message string `json:"message,omitempty"`
	// Status, Dead, DLQ, Audit and Migrations are filled by status,
	// dead-list, dlq-*, audit and migrate.
	Status     *Status      `json:"status,omitempty"`
	Dead       []DeadItem   `json:"dead,omitempty"`
	DLQ        *DLQListing  `json:"dlq,omitempty"`
	Audit      []AuditEntry `json:"audit,omitempty"`
	Migrations []string     `json:"migrations,omitempty"`
}

// Dead-letter queues (Command.From).
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
	// AfterMigrate, when set, runs after the migrations in migrate, as
	// their owner: what the deployment itself needs beside fifobox's
	// tables (functions/redrive: the example consumer's read model).
	AfterMigrate func(ctx context.Context, pool *pgxpool.Pool) error
	// Logger; default slog.Default().
	Logger *slog.Logger
	// Progress, if set, is called as long operations advance (done of total; total -1 if unknown).
	Progress func(op string, done, total int64)
	// Inbox is the consumers' inbox table (inbox.TableFromEnv,
	// FIFOBOX_INBOX_TABLE, as the consumer is configured): dlq-discard marks
	// the discarded events handled there. The zero Table is fifobox's inbox.
	Inbox inbox.Table
	// Transport names the transport's kind in status (sns, rabbitmq, nats).
	Transport string
	// DBError, with a nil pool (New), is why there is no database: status
	// then reports its database sections as such and its queues as usual;
	// every other operation fails with it.
	DBError error
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
	if db == nil && cfg.DBError == nil {
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

// Validate checks a command before anything runs: its operation, that it
// sets only fields its operation takes, the required ones, ranges and
// prune's retentions. Each error is a *FieldError naming the JSON field.
// Execute calls it; the CLI calls it before invoking the redrive Lambda.
func (c Command) Validate() error {
	if err := CheckOperation(c.Operation); err != nil {
		return err
	}
	spec, _ := Spec(c.Operation)
	set := c.fieldsSet()
	for _, f := range set {
		if !spec.Takes(f) {
			return fieldErr(f, "%s does not take it", c.Operation)
		}
	}
	for _, f := range spec.Required {
		if !slices.Contains(set, f) || (f == "reason" && strings.TrimSpace(c.Reason) == "") {
			return fieldErr(f, "required for %s", c.Operation)
		}
	}
	switch {
	case c.Max < 0:
		return fieldErr("max", "%d: must not be negative", c.Max)
	case c.Limit < 0:
		return fieldErr("limit", "%d: must be at least 1", c.Limit)
	case c.From != "" && c.From != SourceDLQ && c.From != SourceSubscriptionDLQ:
		return fieldErr("from", "%q: want %s or %s", c.From, SourceDLQ, SourceSubscriptionDLQ)
	case len(c.Actor) > maxActorLen || strings.ContainsFunc(c.Actor, func(r rune) bool { return r < 0x20 || r == 0x7f }):
		return fieldErr("actor", "at most %d characters without control characters", maxActorLen)
	case c.Since != nil && c.Until != nil && !c.Since.Before(c.Until.Time):
		return fieldErr("since", "must be before until")
	}
	for _, id := range c.EventIDs {
		if _, err := uuid.Parse(id); err != nil {
			return fieldErr("event_ids", "%q: not an event id (a UUID)", id)
		}
	}
	if c.Operation == OpDLQDiscard && len(c.Messages)+len(c.Groups)+len(c.Aggregates) == 0 {
		// Never a whole DLQ by accident: messages are chosen.
		return fieldErr("messages", "choose messages, groups or aggregates to discard")
	}
	if c.Operation == OpDLQPeek && len(c.Messages)+len(c.Groups)+len(c.Aggregates) == 0 {
		return fieldErr("messages", "choose the messages, groups or aggregates to show")
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

// fieldsSet are the JSON names of the arguments c sets.
func (c Command) fieldsSet() []string {
	var out []string
	add := func(name string, set bool) {
		if set {
			out = append(out, name)
		}
	}
	add("consumer", c.Consumer != "")
	add("event_ids", len(c.EventIDs) > 0)
	add("aggregate_type", c.AggregateType != "")
	add("aggregate_ids", len(c.AggregateIDs) > 0)
	add("since", c.Since != nil)
	add("until", c.Until != nil)
	add("dry_run", c.DryRun)
	add("max", c.Max != 0)
	add("limit", c.Limit != 0)
	add("reason", c.Reason != "")
	add("from", c.From != "")
	add("groups", len(c.Groups) > 0)
	add("aggregates", len(c.Aggregates) > 0)
	add("messages", len(c.Messages) > 0)
	add("error", c.Error != "")
	add("older_than", c.OlderThan != 0)
	add("inbox_older_than", c.InboxOlderThan != 0)
	return out
}

// Execute validates and runs one command.
func (s *Service) Execute(ctx context.Context, cmd Command) (Result, error) {
	if err := cmd.Validate(); err != nil {
		return Result{}, err
	}
	if cmd.Actor == "" {
		cmd.Actor = "unknown"
	}
	if spec, _ := Spec(cmd.Operation); cmd.Max == 0 && spec.Takes("max") {
		cmd.Max = defaultMax
	}
	var (
		res Result
		err error
	)
	if s.db == nil && cmd.Operation != OpStatus {
		return Result{Operation: cmd.Operation}, fmt.Errorf("%s: no database: %w", cmd.Operation, s.cfg.DBError)
	}
	switch cmd.Operation {
	case OpMigrate:
		return s.migrate(ctx, cmd)
	case OpStatus:
		return s.status(ctx, cmd)
	case OpDeadList:
		return s.deadList(ctx, cmd)
	case OpAudit:
		return s.audit(ctx, cmd)
	case OpDLQList:
		return s.dlqList(ctx, cmd)
	case OpDLQPeek:
		res, err = s.dlqPeek(ctx, cmd)
	case OpDLQDiscard:
		res, err = s.dlqDiscard(ctx, cmd)
	case OpRetryNow:
		res, err = s.retryNow(ctx, cmd)
	case OpRepairHeads:
		res, err = s.repairHeads(ctx, cmd)
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
	default: // listed in Ops but not handled here
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
		return nil, fieldErr("consumer", "required")
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
