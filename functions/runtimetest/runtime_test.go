package runtimetest

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/internal/lambdaruntime"
	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/lambdafn"
	"github.com/fifobox/fifobox/pkg/lambdafn/dispatcher"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/topology"
)

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// bootstrap builds the three functions once, with scripts/build-lambda.sh
// (the flags `make build` uses) for this machine's architecture, and
// returns the path of fn's bootstrap.
func bootstrap(t *testing.T, fn string) string {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("the bootstraps are linux binaries (provided.al2023)")
	}
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "fifobox-bootstraps")
		if buildErr != nil {
			return
		}
		cmd := exec.Command(filepath.Join(repoRoot(t), "scripts", "build-lambda.sh"), buildDir)
		cmd.Env = append(os.Environ(), "FIFOBOX_LAMBDA_GOARCH="+runtime.GOARCH)
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("scripts/build-lambda.sh: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return filepath.Join(buildDir, fn, "bootstrap")
}

// deployment is one test's stand-in for a deployed local stack: its own
// database schema and topology on the emulator, which the local template's
// references resolve to.
type deployment struct {
	db  *pgtest.DB
	em  *emulatortest.Env
	fns map[string]templateFunction
	tpl template
}

func newDeployment(t *testing.T, migrated bool) *deployment {
	t.Helper()
	fns, tpl := functions(t, loadTemplates(t, localTemplates))
	d := &deployment{fns: fns, tpl: tpl}
	if migrated {
		d.db = pgtest.New(t)
	} else {
		d.db = pgtest.NewEmpty(t)
	}
	d.em = emulatortest.New(t, topology.Default(), 5)
	return d
}

// env is the environment of the function key: what Lambda defines, the
// emulator endpoint (as LocalStack and Floci give their Lambda containers),
// and the template's variables with every reference resolved to this
// test's resources. The template's database URL (the deployment's
// databaseUrl context) becomes this test's schema.
func (d *deployment) env(t *testing.T, key string) (templateFunction, []string) {
	t.Helper()
	f, ok := d.fns[key]
	if !ok {
		t.Fatalf("the local template has no function %s (it has %v)", key, sortedKeys(d.fns))
	}
	if _, ok := f.Env["FIFOBOX_DATABASE_URL"]; !ok {
		t.Fatalf("%s: the local template gives no FIFOBOX_DATABASE_URL", key)
	}
	env := append(lambdaruntime.PlatformEnv("Fifobox-Local-"+f.ID, int(f.Memory)), "AWS_ENDPOINT_URL="+d.em.Endpoint)
	for _, name := range sortedKeys(f.Env) {
		v, err := resolve(d.tpl, f.Env[name], d.resource(t))
		if err != nil {
			t.Fatalf("%s: %s: %v", key, name, err)
		}
		if name == "FIFOBOX_DATABASE_URL" {
			v = d.db.URL
		}
		env = append(env, name+"="+v)
	}
	return f, env
}

// resource resolves a template reference to this test's topic and queues.
// A queue the topology's provisioning does not create is created here.
func (d *deployment) resource(t *testing.T) resolver {
	return func(tpl template, id, attr string) (string, error) {
		r, ok := tpl.Resources[id]
		if !ok {
			return "", fmt.Errorf("reference to %s, which the template does not define", id)
		}
		switch r.Type {
		case "AWS::SNS::Topic":
			return d.em.TopicARN, nil
		case "AWS::SQS::Queue":
			name, _ := r.Properties["QueueName"].(string)
			var prefix string
			for _, q := range d.em.Queues {
				prefix = strings.TrimSuffix(q.Name, q.Consumer.QueueName())
				switch name {
				case q.Consumer.QueueName():
					return pick(attr, q.URL, q.ARN)
				case q.Consumer.DLQName():
					return pick(attr, q.DLQURL, q.DLQARN)
				}
			}
			if name == "" {
				return "", fmt.Errorf("queue %s has no name", id)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			arn := "arn:aws:sqs:us-east-1:000000000000:" + prefix + name
			if got, err := d.em.SQS.GetQueueUrl(ctx, &sqs.GetQueueUrlInput{QueueName: aws.String(prefix + name)}); err == nil {
				return pick(attr, *got.QueueUrl, arn) // provisioned with the topology, under another field
			}
			out, err := d.em.SQS.CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(prefix + name),
				Attributes: map[string]string{"FifoQueue": strconv.FormatBool(strings.HasSuffix(name, ".fifo"))}})
			if err != nil {
				return "", err
			}
			t.Cleanup(func() {
				_, _ = d.em.SQS.DeleteQueue(context.Background(), &sqs.DeleteQueueInput{QueueUrl: out.QueueUrl})
			})
			return pick(attr, *out.QueueUrl, arn)
		}
		return "", fmt.Errorf("no test resource for %s (%s)", id, r.Type)
	}
}

func pick(attr, url, arn string) (string, error) {
	switch attr {
	case "":
		return url, nil
	case "Arn":
		return arn, nil
	}
	return "", fmt.Errorf("queue attribute %s", attr)
}

func orderEvent(t *testing.T, typ, order string) envelope.Envelope {
	t.Helper()
	e, err := envelope.New(typ, "order", order, readmodel.OrderEvent{OrderID: order, CustomerID: "c-1", AmountCents: 1200, Currency: "EUR"})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func enqueue(t *testing.T, db *pgtest.DB, events ...envelope.Envelope) {
	t.Helper()
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, events...) }); err != nil {
		t.Fatal(err)
	}
}

// receiveAll drains queueURL until it has want messages (or 30 s pass) and
// returns the envelopes in arrival order.
func receiveAll(t *testing.T, c *sqs.Client, queueURL string, want int) []envelope.Envelope {
	t.Helper()
	var got []envelope.Envelope
	deadline := time.Now().Add(30 * time.Second)
	for len(got) < want && time.Now().Before(deadline) {
		out, err := c.ReceiveMessage(context.Background(), &sqs.ReceiveMessageInput{QueueUrl: aws.String(queueURL),
			MaxNumberOfMessages: 10, WaitTimeSeconds: 1})
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range out.Messages {
			e, err := envelope.Decode([]byte(aws.ToString(m.Body)))
			if err != nil {
				t.Fatalf("undecodable message %s: %v", aws.ToString(m.Body), err)
			}
			got = append(got, e)
			if _, err := c.DeleteMessage(context.Background(), &sqs.DeleteMessageInput{QueueUrl: aws.String(queueURL), ReceiptHandle: m.ReceiptHandle}); err != nil {
				t.Fatal(err)
			}
		}
	}
	return got
}

func invoke(t *testing.T, srv *lambdaruntime.Server, payload []byte, timeout time.Duration) lambdaruntime.Result {
	t.Helper()
	res, err := srv.Invoke(context.Background(), lambdaruntime.Invocation{Payload: payload, Deadline: time.Now().Add(timeout)}, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if res.TimedOut {
		t.Fatalf("invocation %s: no answer before its deadline (%s); got %s", res.RequestID, timeout, res)
	}
	return res
}

// The dispatcher bootstrap, invoked as the schedule invokes it, publishes
// the events enqueued before the invocation to the topic (each subscribed
// queue gets them, in order per aggregate), answers with its result before
// the deadline it was given, emits its backlog metrics, and serves a second
// invocation from the same process.
func TestDispatcherBinary(t *testing.T) {
	d := newDeployment(t, true)
	_, env := d.env(t, "dispatcher")
	var evs []envelope.Envelope
	for i := range 12 {
		order := fmt.Sprintf("o-%d", i%4)
		evs = append(evs, orderEvent(t, []string{"order.created", "order.paid", "order.shipped"}[i/4], order))
	}
	enqueue(t, d.db, evs...)

	srv := lambdaruntime.NewServer(t, "dispatcher")
	fn := srv.Start(bootstrap(t, "dispatcher"), env)
	// A deadline shorter than the function's 70 s timeout: the contract
	// (return before Lambda-Runtime-Deadline-Ms) is the same.
	const deadline = 8 * time.Second
	res := invoke(t, srv, []byte(`{}`), deadline)
	if res.Err != nil {
		t.Fatalf("invocation failed: %s", res)
	}
	var out dispatcher.Result
	if err := json.Unmarshal(res.Response, &out); err != nil {
		t.Fatalf("response %s: %v", res.Response, err)
	}
	if out.Published != int64(len(evs)) || out.Dead != 0 || out.End.Pending != 0 {
		t.Errorf("response %s: want %d published, none dead or pending", res.Response, len(evs))
	}
	if left := time.Until(res.Deadline); left < 0 {
		t.Errorf("answered %s after the deadline", -left)
	}

	got := receiveAll(t, d.em.SQS, d.em.Queues["audit"].URL, len(evs))
	if len(got) != len(evs) {
		t.Fatalf("audit queue received %d events, want %d", len(got), len(evs))
	}
	seq := map[string]int64{}
	for _, e := range got {
		if e.Sequence <= seq[e.AggregateID] {
			t.Errorf("aggregate %s: sequence %d after %d", e.AggregateID, e.Sequence, seq[e.AggregateID])
		}
		seq[e.AggregateID] = e.Sequence
	}
	if !strings.Contains(fn.Output(), `"`+"OutboxBacklog"+`"`) || !strings.Contains(fn.Output(), `"Namespace":"Fifobox"`) {
		t.Errorf("no backlog metrics in namespace Fifobox (the template's FIFOBOX_METRICS_NAMESPACE) on stdout")
	}

	// A warm invocation: the same process, the next event.
	enqueue(t, d.db, orderEvent(t, "order.created", "o-warm"))
	res = invoke(t, srv, []byte(`{}`), 5*time.Second)
	if err := json.Unmarshal(res.Response, &out); err != nil || out.Published != 1 {
		t.Errorf("second invocation: %s, want 1 published", res)
	}
	select {
	case <-fn.Exited():
		t.Errorf("the process exited after its invocations: %v", fn.ExitErr())
	default:
	}
}

// The consumer bootstrap answers an SQS FIFO batch with one failing record
// with exactly the batchItemFailures Lambda's FIFO contract asks for: that
// record and the later records of its message group, nothing else; the
// other groups' records are applied.
func TestConsumerBinaryReportsBatchItemFailures(t *testing.T) {
	d := newDeployment(t, true)
	_, env := d.env(t, "consumer:orders-projection")
	// A side effect that fails for one order, as a database error would.
	ctx := context.Background()
	if _, err := d.db.Pool.Exec(ctx, `
CREATE FUNCTION fail_order() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.order_id = 'o-fail' THEN RAISE EXCEPTION 'injected failure for order %', NEW.order_id; END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER fail_order BEFORE INSERT OR UPDATE ON orders_read_model FOR EACH ROW EXECUTE FUNCTION fail_order();`); err != nil {
		t.Fatal(err)
	}
	batch := []envelope.Envelope{
		orderEvent(t, "order.created", "o-1"),
		orderEvent(t, "order.created", "o-fail"),
		orderEvent(t, "order.paid", "o-fail"),
		orderEvent(t, "order.created", "o-2"),
	}
	batch[2].Sequence = 2
	for i := range batch {
		if batch[i].Sequence == 0 {
			batch[i].Sequence = 1
		}
	}
	ev := sqsEvent(t, d.em.Queues["orders-projection"].ARN, batch)

	srv := lambdaruntime.NewServer(t, "consumer-orders-projection")
	srv.Start(bootstrap(t, "consumer"), env)
	payload, _ := json.Marshal(ev)
	res := invoke(t, srv, payload, 20*time.Second)
	if res.Err != nil {
		t.Fatalf("invocation failed as a whole (the batch would come back entire): %s", res)
	}
	var resp events.SQSEventResponse
	dec := json.NewDecoder(strings.NewReader(string(res.Response)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&resp); err != nil {
		t.Fatalf("response %s is not an SQSEventResponse: %v", res.Response, err)
	}
	var failed []string
	for _, f := range resp.BatchItemFailures {
		failed = append(failed, f.ItemIdentifier)
	}
	if want := []string{ev.Records[1].MessageId, ev.Records[2].MessageId}; !slices.Equal(failed, want) {
		t.Errorf("batchItemFailures %v, want %v (the failed record and the later one of its group)", failed, want)
	}
	if !strings.Contains(string(res.Response), `"batchItemFailures"`) || !strings.Contains(string(res.Response), `"itemIdentifier"`) {
		t.Errorf("response %s lacks Lambda's field names", res.Response)
	}
	var applied []string
	rows, _ := d.db.Pool.Query(ctx, `SELECT order_id FROM orders_read_model ORDER BY order_id`)
	applied, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(applied, []string{"o-1", "o-2"}) {
		t.Errorf("read model holds %v, want the other groups' orders o-1 and o-2", applied)
	}
}

// sqsEvent is the event Lambda's SQS event source mapping sends for a FIFO
// queue: one record per message, group id and receive count in attributes.
func sqsEvent(t *testing.T, queueARN string, evs []envelope.Envelope) events.SQSEvent {
	t.Helper()
	var out events.SQSEvent
	now := strconv.FormatInt(time.Now().UnixMilli(), 10)
	for i, e := range evs {
		body, err := e.Encode()
		if err != nil {
			t.Fatal(err)
		}
		attrs := map[string]events.SQSMessageAttribute{}
		for k, v := range e.Attributes() {
			attrs[k] = events.SQSMessageAttribute{StringValue: aws.String(v), DataType: "String"}
		}
		out.Records = append(out.Records, events.SQSMessage{
			MessageId:     fmt.Sprintf("00000000-0000-4000-8000-%012d", i+1),
			ReceiptHandle: fmt.Sprintf("receipt-%d", i+1),
			Body:          string(body),
			Attributes: map[string]string{
				"ApproximateReceiveCount": "1", "SentTimestamp": now, "ApproximateFirstReceiveTimestamp": now,
				"MessageGroupId": e.AggregateID, "MessageDeduplicationId": e.ID, "SequenceNumber": fmt.Sprintf("180000000000000000%02d", i),
				"SenderId": "AIDAEXAMPLE",
			},
			MessageAttributes: attrs,
			EventSource:       "aws:sqs",
			EventSourceARN:    queueARN,
			AWSRegion:         "us-east-1",
		})
	}
	return out
}

// The redrive (operations) bootstrap runs the migrations when invoked with
// no payload, as the CDK deploy trigger invokes it (Lambda then delivers
// {}), answers status with the backlog and every queue of FIFOBOX_QUEUES,
// and reports an unknown operation through the invocation-error endpoint.
func TestRedriveBinary(t *testing.T) {
	d := newDeployment(t, false)
	_, env := d.env(t, "redrive")
	srv := lambdaruntime.NewServer(t, "redrive")
	srv.Start(bootstrap(t, "redrive"), env)

	res := invoke(t, srv, nil, 60*time.Second)
	var out redrive.Result
	if res.Err != nil || json.Unmarshal(res.Response, &out) != nil || out.Operation != "migrate" {
		t.Fatalf("deploy trigger's invocation: %s, want the migrate result", res)
	}
	var tables int
	if err := d.db.Pool.QueryRow(context.Background(),
		`SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name IN ('outbox', 'inbox', 'redrive_audit')`, d.db.Schema).Scan(&tables); err != nil || tables != 3 {
		t.Errorf("after migrate: %d of the outbox, inbox and audit tables (%v)", tables, err)
	}

	enqueue(t, d.db, orderEvent(t, "order.created", "o-1"))
	res = invoke(t, srv, []byte(`{"operation":"status"}`), 20*time.Second)
	out = redrive.Result{}
	if res.Err != nil || json.Unmarshal(res.Response, &out) != nil || out.Status == nil {
		t.Fatalf("status: %s", res)
	}
	b, _ := json.Marshal(out.Status)
	// (outbox.Backlog's JSON field names are not fixed yet: match either case.)
	if !strings.Contains(strings.ToLower(string(b)), `"pending":1`) {
		t.Errorf("status %s: want the one pending event", b)
	}
	for _, c := range topology.Default().Consumers {
		if !strings.Contains(string(b), `"`+c.Name+`"`) {
			t.Errorf("status %s lacks queue %s (FIFOBOX_QUEUES)", b, c.Name)
		}
	}

	res = invoke(t, srv, []byte(`{"operation":"reticulate"}`), 20*time.Second)
	if res.Err == nil || !strings.Contains(res.Err.ErrorMessage, `unknown operation "reticulate"`) {
		t.Errorf("unknown operation: %s, want an invocation error naming it", res)
	}
}

// A function whose init fails (a required variable missing, a database
// setting absent, a bad value) reports it to the init-error endpoint with a
// message naming the variable, asks for no invocation, and exits.
func TestInitFailureReachesTheRuntimeAPI(t *testing.T) {
	d := newDeployment(t, true)
	type tc struct{ fn, unset, set, want string }
	var cases []tc
	for _, key := range []string{"dispatcher", "consumer:audit", "redrive"} {
		spec := functionSpecs[d.fns[key].Binary]
		for _, v := range spec.env {
			if v.Required {
				cases = append(cases, tc{key, v.Name, "", v.Name})
			}
		}
		cases = append(cases, tc{key, "FIFOBOX_DATABASE_URL", "", "FIFOBOX_DATABASE_URL"})
	}
	cases = append(cases, tc{"redrive", "", "FIFOBOX_DEFAULT_OPERATION=migrat", "FIFOBOX_DEFAULT_OPERATION"})
	// dlq-discard writes to the consumers' inbox table: a bad one stops the
	// operations function at init, as it stops a consumer.
	cases = append(cases, tc{"redrive", "", `FIFOBOX_INBOX_TABLE={"table": "1nbox"}`, "FIFOBOX_INBOX_TABLE"})
	for _, c := range cases {
		t.Run(c.fn+"/"+c.want, func(t *testing.T) {
			f, env := d.env(t, c.fn)
			env = slices.DeleteFunc(env, func(kv string) bool {
				return c.unset != "" && strings.HasPrefix(kv, c.unset+"=") || c.set != "" && strings.HasPrefix(kv, strings.SplitN(c.set, "=", 2)[0]+"=")
			})
			if c.set != "" {
				env = append(env, c.set)
			}
			srv := lambdaruntime.NewServer(t, c.fn)
			fn := srv.Start(bootstrap(t, f.Binary), env)
			select {
			case <-srv.InitFailed():
			case <-srv.Ready():
				t.Fatalf("init succeeded (asked for an invocation)")
			case <-fn.Exited():
			case <-time.After(30 * time.Second):
				t.Fatalf("no init error within 30 s")
			}
			ie := srv.InitError()
			if ie == nil {
				t.Fatalf("the process exited (%v) without reporting an init error: Lambda would only say the runtime exited", fn.ExitErr())
			}
			if !strings.Contains(ie.Doc.ErrorMessage, c.want) || ie.Doc.ErrorType != lambdafn.InitError || ie.ErrorType != lambdafn.InitError {
				t.Errorf("init error %s (header %q), want %s naming %s", ie.Raw, ie.ErrorType, lambdafn.InitError, c.want)
			}
			if err := fn.WaitExit(10 * time.Second); err != nil {
				t.Fatal(err)
			}
			if fn.ExitErr() == nil {
				t.Errorf("exited with status 0 after a failed init")
			}
		})
	}
}
