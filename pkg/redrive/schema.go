package redrive

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
)

// The operation schema: every operation the redrive Lambda runs and the
// fifobox CLI offers, with its arguments, is declared once here. The CLI
// builds its commands and flags from Ops (a flag is its argument's name in
// kebab-case), turns the flags into the same JSON the Lambda is invoked
// with, and both decode that JSON with DecodeCommand: one list of
// operations, one set of argument names, one parser for durations and
// times, one set of errors (each naming its argument; the CLI shows the
// flag).

// ArgKind is an argument's JSON type and how its text is read.
type ArgKind string

// Argument kinds.
const (
	KindString   ArgKind = "string"
	KindStrings  ArgKind = "strings"  // a JSON array; a repeatable, comma-separated flag
	KindInt      ArgKind = "int"      // a JSON number
	KindBool     ArgKind = "bool"     // a JSON boolean; a flag without a value
	KindDuration ArgKind = "duration" // seconds as a JSON number, or text such as "90s", "24h", "7d"
	KindTime     ArgKind = "time"     // RFC 3339, a date ("2026-11-01", UTC), or a duration ago ("24h", "7d")
)

// Arg is one argument: its JSON field (snake_case) and CLI flag (the same
// words in kebab-case, singular for a repeatable one).
type Arg struct {
	Name string
	Flag string
	Kind ArgKind
	Doc  string
}

// args are every argument an operation may take, by JSON name.
var args = map[string]Arg{
	"consumer":         {Flag: "consumer", Kind: KindString, Doc: "the consumer (its inbox name, as in the topology)"},
	"event_ids":        {Flag: "event-id", Kind: KindStrings, Doc: "event id (repeatable or comma-separated)"},
	"aggregate_type":   {Flag: "aggregate-type", Kind: KindString, Doc: "aggregate type"},
	"aggregate_ids":    {Flag: "aggregate-id", Kind: KindStrings, Doc: "aggregate id (repeatable)"},
	"since":            {Flag: "since", Kind: KindTime, Doc: "created at or after: RFC 3339, a date (2026-11-01, UTC) or a duration ago (24h, 7d)"},
	"until":            {Flag: "until", Kind: KindTime, Doc: "created before: RFC 3339, a date or a duration ago"},
	"dry_run":          {Flag: "dry-run", Kind: KindBool, Doc: "count what would change, change nothing"},
	"max":              {Flag: "max", Kind: KindInt, Doc: "at most this many (default 100000)"},
	"limit":            {Flag: "limit", Kind: KindInt, Doc: "rows to show"},
	"reason":           {Flag: "reason", Kind: KindString, Doc: "why (recorded in the audit)"},
	"from":             {Flag: "from", Kind: KindString, Doc: "dlq (the consumer queue's DLQ) or subscription-dlq (SNS: what SNS could not deliver)"},
	"groups":           {Flag: "group", Kind: KindStrings, Doc: "message group, the aggregate id (repeatable)"},
	"aggregates":       {Flag: "aggregate", Kind: KindStrings, Doc: "aggregate as type/id, or an id (repeatable)"},
	"messages":         {Flag: "message", Kind: KindStrings, Doc: "message key (event id, sha256:..., or the broker's message id; repeatable)"},
	"error":            {Flag: "error", Kind: KindString, Doc: "only aggregates whose last publish error contains this text"},
	"older_than":       {Flag: "older-than", Kind: KindDuration, Doc: "retention for sent events (at least 24h; default 7d)"},
	"inbox_older_than": {Flag: "inbox-older-than", Kind: KindDuration, Doc: "retention for inbox rows (at least 15d: longer than the DLQs keep a message; default 30d)"},
}

// OpSpec is one operation.
type OpSpec struct {
	// Name is the operation as the redrive Lambda receives it
	// ({"operation": Name}): the CLI's command words joined by "-".
	Name string
	// Command is the CLI command's words ("dead", "requeue").
	Command []string
	// Short and Long describe it (the CLI's help); Example shows CLI lines.
	Short, Long, Example string
	// Args are its arguments' JSON names; Required those it cannot do without.
	Args, Required []string
	// Changes: it changes something, and is audited (dry runs too).
	Changes bool
	// Broker: it needs the transport's operations.
	Broker bool
	// Confirm: on a terminal the CLI shows a dry run and asks before
	// running it (unless --yes): the operation throws something away.
	Confirm bool
	// Progress: it may run long and reports progress.
	Progress bool
}

// Ops are every operation, in the order the docs give them.
var Ops = []OpSpec{
	{Name: OpMigrate, Command: []string{"migrate"}, Changes: true,
		Short: "Apply the outbox, inbox and audit migrations (idempotent) and say which ran"},
	{Name: OpStatus, Command: []string{"status"}, Args: []string{"consumer"}, Broker: true,
		Short: "Show the outbox backlog, why events retry or died, and each consumer's queue, DLQ and held groups",
		Long: `status shows three sections: the outbox (backlog, publish lag, retrying, parked and
dead events), why events retry or died (the most frequent publish errors, with
counts and the newest message; never payloads), and each consumer's queue, DLQ
and held groups. A section that cannot be read says so and why, on stderr and
in --json ("state": "unreachable", "missing" or "error", per section and per
queue), and status then exits 1.`},
	{Name: OpDeadList, Command: []string{"dead", "list"}, Args: []string{"limit", "aggregate_type"},
		Short: "List dead outbox events with their last error, oldest first (no payloads)"},
	{Name: OpRequeueDead, Command: []string{"dead", "requeue"}, Args: []string{"event_ids", "aggregate_type", "since", "until", "dry_run", "max"},
		Changes: true, Progress: false,
		Short: "Put dead events back to pending; each aggregate publishes them in order, then what was parked behind them",
		Example: `  fifobox dead requeue --event-id 0193c1f4-1c2d-7000-8000-000000000001
  fifobox dead requeue --aggregate-type order --since 24h --dry-run`},
	{Name: OpDiscardDead, Command: []string{"dead", "discard"}, Args: []string{"event_ids", "reason", "dry_run"},
		Required: []string{"event_ids", "reason"}, Changes: true, Confirm: true,
		Short: "Give up for good on dead events no broker will accept; their aggregates resume with the events after them",
		Long: `discard marks the given dead events 'discarded': they are never published,
and each aggregate they parked resumes with its next event. Consumers never
see a discarded event (its sequence number is skipped). Use it for an event
the broker rejects permanently (too large, invalid attribute); requeue instead
when the cause was transient. Audited; on a terminal it asks first (--yes
does not).`,
		Example: `  fifobox dead discard --event-id 0193c1f4-1c2d-7000-8000-000000000001 --reason "over 256 KiB, re-issued" --dry-run`},
	{Name: OpRetryNow, Command: []string{"retry-now"}, Args: []string{"aggregate_type", "aggregate_ids", "error", "dry_run", "max"},
		Changes: true,
		Short:   "Make aggregates that back off after a failed publish due now, so the next dispatch publishes them",
		Long: `After a failed publish an aggregate backs off (up to 5 minutes by default) before
its next attempt. Once the cause is fixed (a topic restored, a permission
granted), retry-now makes the selected backing-off aggregates due at once; the
next dispatch publishes them, in order. How long they have been failing, which
decides when an event goes dead, is kept. Audited.`,
		Example: `  fifobox retry-now --dry-run
  fifobox retry-now --error NotFoundException
  fifobox retry-now --aggregate-type order --aggregate-id order-42`},
	{Name: OpRepairHeads, Command: []string{"repair-heads"}, Args: []string{"dry_run"}, Changes: true,
		Short: "Make stranded outbox events publishable: derive every aggregate's head from its unsent events",
		Long: `An event written into the outbox around fifobox's enqueue path (by the table owner
with aggregate_seq set) is never claimed unless its aggregate has a head: status
counts it as stranded once it has waited 5 minutes, and so does the
OutboxStrandedEvents alarm. repair-heads gives every aggregate with an unsent
event a head at its lowest one, so the next dispatch publishes them in order. It
never moves a head a dispatcher holds, so it is safe while dispatchers run.
Audited.`,
		Example: `  fifobox repair-heads --dry-run
  fifobox repair-heads`},
	{Name: OpDLQRedrive, Command: []string{"redrive"}, Args: []string{"consumer", "from", "groups", "aggregates", "dry_run", "max"},
		Required: []string{"consumer"}, Changes: true, Broker: true, Progress: true,
		Short: "Move a consumer's DLQ (or subscription DLQ) messages back to its queue, keeping message groups and their order",
		Long: `redrive moves the messages of a consumer's DLQ back to its queue, each message group
in order (--group or --aggregate: only those). A consumer in strict order (the
default) applies a held aggregate's events as they come back, the dead one first,
and then releases the aggregate. Messages dead-lettered again while the redrive
runs stay for the next one.

--from subscription-dlq moves what SNS could not deliver to the consumer's queue
(a disabled KMS key, a changed queue policy): those events never reached the
consumer, so later events of their aggregates may have been applied before them.`,
		Example: `  fifobox redrive --consumer shipping --dry-run
  fifobox redrive --consumer shipping --group order-42
  fifobox redrive --consumer shipping --from subscription-dlq`},
	{Name: OpDLQList, Command: []string{"dlq", "list"}, Args: []string{"consumer", "from", "groups", "aggregates", "limit"},
		Required: []string{"consumer"}, Broker: true,
		Short: "List a consumer's dead-lettered messages and why they died, leaving every one in place (no payloads)",
		Long: `dlq list shows the messages in a consumer's DLQ (event, group, why it died),
leaving every one where it was: nothing stays in flight and each group keeps its
order. An SQS FIFO queue shows a group's later messages only once the earlier
ones are gone, so on SNS/SQS the list may show each group's first messages only;
for a consumer in strict order the held groups (from the database) list every
message waiting behind them.`,
		Example: `  fifobox dlq list --consumer shipping
  fifobox dlq list --consumer shipping --group order-42`},
	{Name: OpDLQPeek, Command: []string{"dlq", "peek"}, Args: []string{"consumer", "from", "messages", "groups", "aggregates", "limit"},
		Required: []string{"consumer"}, Broker: true, Changes: true,
		Short:   "Show dead-lettered messages with their bodies, leaving every one in place (audited: it shows payloads)",
		Example: `  fifobox dlq peek --consumer shipping --message 0193c1f4-1c2d-7000-8000-000000000001`},
	{Name: OpDLQDiscard, Command: []string{"dlq", "discard"}, Args: []string{"consumer", "from", "messages", "groups", "aggregates", "reason", "dry_run", "max"},
		Required: []string{"consumer", "reason"}, Changes: true, Broker: true, Confirm: true, Progress: true,
		Short: "Delete chosen messages (or groups) from a consumer's DLQ for good; the rest stay, in order",
		Long: `dlq discard deletes the chosen messages (--message) or whole groups (--group,
--aggregate) from a consumer's DLQ; every other message stays where it was, in
order. For a consumer in strict order the discarded messages leave their group's
hold, so the group's remaining messages apply in order when redriven (the next
one first). Audited with --reason; on a terminal it shows what it would delete and
asks first (--yes does not). On SNS/SQS a message behind its group's first one
can be reached only once the ones before it are gone.`,
		Example: `  fifobox dlq discard --consumer shipping --message 0193c1f4-1c2d-7000-8000-000000000001 --reason "poison: bad currency" --dry-run
  fifobox dlq discard --consumer shipping --group order-42 --reason "test data" --yes`},
	{Name: OpReleaseHolds, Command: []string{"release-holds"}, Args: []string{"consumer", "groups", "dry_run", "max"},
		Required: []string{"consumer"}, Changes: true,
		Short: "End a strict-order consumer's holds whose dead-lettered messages are gone (purged or expired)",
		Long: `A consumer in strict order holds an aggregate once it dead-letters one of its events:
later events go to the DLQ behind it until redrive brings them back in order. If the
dead-lettered messages are gone (purged, expired after the DLQ's 14 days), the hold would
never end: release-holds ends it, so the aggregate's next events are applied as they come.
Redrive first if the messages are still in the DLQ (fifobox status shows both counts).`,
		Example: `  fifobox release-holds --consumer shipping --dry-run
  fifobox release-holds --consumer shipping --group order-42`},
	{Name: OpReplay, Command: []string{"replay"}, Args: []string{"consumer", "aggregate_type", "since", "until", "dry_run", "max"},
		Required: []string{"consumer", "aggregate_type", "since"}, Changes: true, Broker: true, Progress: true,
		Short: "Send sent events again to ONE consumer, clearing its inbox entries for them so it re-applies them",
		Long: `replay rebuilds a consumer's read model: the chosen sent events (by aggregate type and
time range) are sent again to that consumer's queue only, in per-aggregate order, and
that consumer's inbox rows for exactly those events are deleted in the same audited
operation. Other consumers see nothing.`,
		Example: `  fifobox replay --consumer orders-projection --aggregate-type order --since 2026-11-01`},
	{Name: OpPrune, Command: []string{"prune"}, Args: []string{"older_than", "inbox_older_than", "dry_run"},
		Changes: true, Progress: true,
		Short: "Delete sent outbox events and inbox rows past their retention, in bounded batches",
		Long: `Delete sent outbox events older than --older-than and inbox rows older than
--inbox-older-than, in bounded batches. Deployed, a daily schedule runs this in
the redrive Lambda with the defaults. Keep the inbox retention longer than the
DLQs' message retention (14 days at most): a redriven message that was applied
before is recognised only while its inbox row exists.`,
		Example: `  fifobox prune --older-than 7d --inbox-older-than 30d --dry-run`},
	{Name: OpAudit, Command: []string{"audit"}, Args: []string{"limit"},
		Short: "Show the most recent operator actions (redrive_audit), newest first"},
}

// Spec returns the operation named name.
func Spec(name string) (OpSpec, bool) {
	i := slices.IndexFunc(Ops, func(o OpSpec) bool { return o.Name == name })
	if i < 0 {
		return OpSpec{}, false
	}
	return Ops[i], true
}

// ArgSpec returns the argument named name (its JSON field).
func ArgSpec(name string) (Arg, bool) {
	a, ok := args[name]
	a.Name = name
	return a, ok
}

// Takes reports whether the operation takes the argument.
func (o OpSpec) Takes(arg string) bool { return slices.Contains(o.Args, arg) }

// FieldError is an invalid or missing argument, named by its JSON field.
// The CLI shows the field's flag instead (FlagError).
type FieldError struct {
	Field string
	Err   error
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Err.Error() }
func (e *FieldError) Unwrap() error { return e.Err }

func fieldErr(field, format string, a ...any) error {
	return &FieldError{Field: field, Err: fmt.Errorf(format, a...)}
}

// FlagError rewrites a FieldError inside err to name the CLI flag.
func FlagError(err error) error {
	var fe *FieldError
	if !errors.As(err, &fe) {
		return err
	}
	a, ok := ArgSpec(fe.Field)
	if !ok {
		return err
	}
	msg := strings.Replace(err.Error(), fe.Error(), "--"+a.Flag+": "+fe.Err.Error(), 1)
	return &flagError{msg: msg, err: err}
}

type flagError struct {
	msg string
	err error
}

func (e *flagError) Error() string { return e.msg }
func (e *flagError) Unwrap() error { return e.err }

// globalFields are the fields every operation's JSON may carry.
var globalFields = []string{"operation", "actor"}

// DecodeCommand reads one operator command from JSON, as the redrive Lambda
// receives it and the CLI builds it: {"operation": "...", "actor": "...",
// and the operation's arguments}. A field the operation does not take is
// refused, naming it and what the operation takes, so a misspelt option is
// never silently ignored. An empty payload or null is an empty command
// (operation defaultOp).
func DecodeCommand(payload []byte, defaultOp string) (Command, error) {
	var cmd Command
	p := bytes.TrimSpace(payload)
	if len(p) == 0 || bytes.Equal(p, []byte("null")) {
		cmd.Operation = defaultOp
		return cmd, CheckOperation(cmd.Operation)
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(p, &fields); err != nil {
		return cmd, fmt.Errorf("command: want a JSON object: %w", err)
	}
	var op string
	if raw, ok := fields["operation"]; ok {
		if err := json.Unmarshal(raw, &op); err != nil {
			return cmd, fieldErr("operation", "want a string")
		}
	}
	if op == "" {
		op = defaultOp
	}
	if err := CheckOperation(op); err != nil {
		return cmd, err
	}
	spec, _ := Spec(op)
	for name := range fields {
		if slices.Contains(globalFields, name) || spec.Takes(name) {
			continue
		}
		takes := append(slices.Clone(spec.Args), globalFields...)
		sort.Strings(takes)
		return cmd, fieldErr(name, "%s does not take it (it takes %s)", op, strings.Join(takes, ", "))
	}
	for name, raw := range fields {
		if err := decodeField(&cmd, name, raw); err != nil {
			return cmd, err
		}
	}
	cmd.Operation = op
	return cmd, nil
}

// decodeField sets one field of cmd from its JSON.
func decodeField(cmd *Command, name string, raw json.RawMessage) error {
	if name == "operation" {
		return nil
	}
	if name == "actor" {
		if err := json.Unmarshal(raw, &cmd.Actor); err != nil {
			return fieldErr(name, "want a string")
		}
		return nil
	}
	a, _ := ArgSpec(name)
	var err error
	switch a.Kind {
	case KindString:
		var s string
		if err = json.Unmarshal(raw, &s); err != nil {
			return fieldErr(name, "want a string")
		}
		*cmd.stringField(name) = s
	case KindStrings:
		var ss []string
		if err = json.Unmarshal(raw, &ss); err != nil {
			var s string
			if json.Unmarshal(raw, &s) != nil {
				return fieldErr(name, "want an array of strings")
			}
			ss = []string{s}
		}
		*cmd.stringsField(name) = ss
	case KindInt:
		var f float64
		if err = json.Unmarshal(raw, &f); err != nil || f != math.Trunc(f) || math.Abs(f) > math.MaxInt32 {
			return fieldErr(name, "want a whole number")
		}
		switch {
		case name == "limit" && f < 1:
			return fieldErr(name, "%v: must be at least 1", f)
		case name == "max" && f < 1:
			return fieldErr(name, "%v: must be at least 1", f)
		}
		*cmd.intField(name) = int(f)
	case KindBool:
		if err = json.Unmarshal(raw, &cmd.DryRun); err != nil {
			return fieldErr(name, "want true or false")
		}
	case KindDuration:
		var d Duration
		if err = d.UnmarshalJSON(raw); err != nil {
			return &FieldError{Field: name, Err: err}
		}
		if d <= 0 {
			return fieldErr(name, "%s: must be positive", string(raw))
		}
		*cmd.durationField(name) = d
	case KindTime:
		var t Instant
		if err = t.UnmarshalJSON(raw); err != nil {
			return &FieldError{Field: name, Err: err}
		}
		*cmd.timeField(name) = &t
	}
	return nil
}

func (c *Command) stringField(name string) *string {
	switch name {
	case "consumer":
		return &c.Consumer
	case "aggregate_type":
		return &c.AggregateType
	case "reason":
		return &c.Reason
	case "from":
		return &c.From
	case "error":
		return &c.Error
	}
	panic("redrive: no string field " + name)
}

func (c *Command) stringsField(name string) *[]string {
	switch name {
	case "event_ids":
		return &c.EventIDs
	case "aggregate_ids":
		return &c.AggregateIDs
	case "groups":
		return &c.Groups
	case "aggregates":
		return &c.Aggregates
	case "messages":
		return &c.Messages
	}
	panic("redrive: no strings field " + name)
}

func (c *Command) intField(name string) *int {
	switch name {
	case "max":
		return &c.Max
	case "limit":
		return &c.Limit
	}
	panic("redrive: no int field " + name)
}

func (c *Command) durationField(name string) *Duration {
	switch name {
	case "older_than":
		return &c.OlderThan
	case "inbox_older_than":
		return &c.InboxOlderThan
	}
	panic("redrive: no duration field " + name)
}

func (c *Command) timeField(name string) **Instant {
	switch name {
	case "since":
		return &c.Since
	case "until":
		return &c.Until
	}
	panic("redrive: no time field " + name)
}

// Duration is a span of time: seconds as a JSON number, read from a
// number or from text such as "90s", "24h", "7d" or "1d12h".
type Duration time.Duration

// MarshalJSON writes seconds.
func (d Duration) MarshalJSON() ([]byte, error) {
	return []byte(strconv.FormatFloat(time.Duration(d).Seconds(), 'f', -1, 64)), nil
}

// UnmarshalJSON reads seconds or a duration text.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var f float64
	if err := json.Unmarshal(b, &f); err == nil {
		if f < 0 || math.IsInf(f, 0) || f > float64(math.MaxInt64)/float64(time.Second) {
			return fmt.Errorf("%v: want seconds, not negative", f)
		}
		*d = Duration(time.Duration(f * float64(time.Second)))
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return errors.New(`want seconds or a duration such as "24h" or "7d"`)
	}
	v, err := ParseDuration(s)
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// String is the duration in days and Go's notation ("7d", "36h0m0s").
func (d Duration) String() string { return FormatDuration(time.Duration(d)) }

// ParseDuration reads a duration: a Go duration ("90s", "24h"), days ("7d",
// "1.5d", "1d12h"), or seconds ("3600"). Negative durations are refused.
func ParseDuration(s string) (time.Duration, error) {
	t := strings.TrimSpace(s)
	bad := fmt.Errorf("%q: want a duration such as 90s, 24h or 7d", s)
	if t == "" {
		return 0, bad
	}
	if f, err := strconv.ParseFloat(t, 64); err == nil {
		if f < 0 {
			return 0, bad
		}
		return time.Duration(f * float64(time.Second)), nil
	}
	var days float64
	if i := strings.IndexByte(t, 'd'); i > 0 {
		f, err := strconv.ParseFloat(t[:i], 64)
		if err != nil {
			return 0, bad
		}
		days, t = f, t[i+1:]
	}
	var rest time.Duration
	if t != "" {
		v, err := time.ParseDuration(t)
		if err != nil {
			return 0, bad
		}
		rest = v
	}
	d := time.Duration(days*24*float64(time.Hour)) + rest
	if d < 0 || days < 0 {
		return 0, bad
	}
	return d, nil
}

// FormatDuration writes d in whole days when it is whole days ("7d"), else
// as Go does.
func FormatDuration(d time.Duration) string {
	if d > 0 && d%(24*time.Hour) == 0 {
		return strconv.FormatInt(int64(d/(24*time.Hour)), 10) + "d"
	}
	return d.String()
}

// Instant is a point in time: RFC 3339 in JSON, read from RFC 3339, a date
// ("2026-11-01", midnight UTC) or a duration ago ("24h", "7d": that long
// before it is read).
type Instant struct{ time.Time }

// MarshalJSON writes RFC 3339.
func (t Instant) MarshalJSON() ([]byte, error) {
	return json.Marshal(t.UTC().Format(time.RFC3339Nano))
}

// UnmarshalJSON reads any of the accepted forms.
func (t *Instant) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return errors.New(`want a string: RFC 3339, a date ("2026-11-01") or a duration ago ("24h", "7d")`)
	}
	v, err := ParseTime(s, time.Now())
	if err != nil {
		return err
	}
	t.Time = v
	return nil
}

// ParseTime reads a time: RFC 3339 ("2026-11-23T10:00:00Z"), a date
// ("2026-11-01", midnight UTC), or a duration before now ("24h", "7d").
func ParseTime(s string, now time.Time) (time.Time, error) {
	t := strings.TrimSpace(s)
	if v, err := time.Parse(time.RFC3339Nano, t); err == nil {
		return v, nil
	}
	if v, err := time.Parse(time.DateOnly, t); err == nil {
		return v, nil
	}
	if d, err := ParseDuration(t); err == nil && t != "" && strings.ContainsAny(t, "smhd") {
		return now.Add(-d).UTC(), nil
	}
	return time.Time{}, fmt.Errorf("%q: want RFC 3339 (2026-11-23T10:00:00Z), a date (2026-11-01) or a duration ago (24h, 7d)", s)
}

// JSON returns cmd as the JSON DecodeCommand reads (and the Lambda is
// invoked with): only the fields set, durations in seconds, times in RFC 3339.
func (c Command) JSON() ([]byte, error) { return json.Marshal(c) }
