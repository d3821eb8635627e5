package stacks_test

// The one CDK test package: every test shares one jsii (Node) process and
// each app is synthesised once (sync.Once). Assertions run in Go on the
// synthesised templates (assertions.Template.ToJSON); cdk-nag findings come
// from assertions.Annotations.

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/aws-cdk-go/awscdk/v2/assertions"
	"github.com/aws/jsii-runtime-go"

	"github.com/fifobox/fifobox/infra/stacks"
	"github.com/fifobox/fifobox/pkg/topology"
)

var assetDir string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "fifobox-infra-assets")
	if err != nil {
		panic(err)
	}
	// Dummy bootstraps: the tests check templates, not binaries.
	for _, fn := range []string{stacks.FnDispatcher, stacks.FnConsumer, stacks.FnRedrive} {
		if err := os.MkdirAll(filepath.Join(dir, fn), 0o755); err != nil {
			panic(err)
		}
		if err := os.WriteFile(filepath.Join(dir, fn, "bootstrap"), []byte("#!/bin/sh\n"), 0o755); err != nil {
			panic(err)
		}
	}
	assetDir = dir
	code := m.Run()
	jsii.Close()
	os.RemoveAll(dir)
	os.Exit(code)
}

// template is a synthesised CloudFormation template.
type template map[string]any

type resource struct {
	ID    string
	Type  string
	Props map[string]any
	Meta  map[string]any
}

func (t template) resources(typ string) []resource {
	var out []resource
	res, _ := t["Resources"].(map[string]any)
	ids := make([]string, 0, len(res))
	for id := range res {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		r := res[id].(map[string]any)
		if typ != "" && r["Type"] != typ {
			continue
		}
		props, _ := r["Properties"].(map[string]any)
		meta, _ := r["Metadata"].(map[string]any)
		out = append(out, resource{ID: id, Type: r["Type"].(string), Props: props, Meta: meta})
	}
	return out
}

func (t template) resource(id string) resource {
	res, _ := t["Resources"].(map[string]any)
	r, ok := res[id].(map[string]any)
	if !ok {
		return resource{}
	}
	props, _ := r["Properties"].(map[string]any)
	return resource{ID: id, Type: r["Type"].(string), Props: props}
}

// refID returns the logical id a {"Ref"} or {"Fn::GetAtt"} points at.
func refID(v any) string {
	m, ok := v.(map[string]any)
	if !ok {
		return ""
	}
	if r, ok := m["Ref"].(string); ok {
		return r
	}
	if ga, ok := m["Fn::GetAtt"].([]any); ok && len(ga) > 0 {
		s, _ := ga[0].(string)
		return s
	}
	return ""
}

func dig(v any, path ...string) any {
	for _, p := range path {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[p]
	}
	return v
}

func num(v any) float64 {
	switch n := v.(type) {
	case float64:
		return n
	case string:
		var f float64
		fmt.Sscan(n, &f)
		return f
	}
	return -1
}

type synthesised struct {
	stateful, stateless, local template
	nagErrors, nagWarnings     []string
	statelessStack             *stacks.StatelessStack
}

func newApp(t *testing.T) awscdk.App {
	// The same feature flags as `cdk synth` (cdk.json context).
	b, err := os.ReadFile("../cdk.json")
	if err != nil {
		t.Fatal(err)
	}
	var cdkJSON struct {
		Context map[string]any `json:"context"`
	}
	if err := json.Unmarshal(b, &cdkJSON); err != nil {
		t.Fatal(err)
	}
	return awscdk.NewApp(&awscdk.AppProps{Context: &cdkJSON.Context, AnalyticsReporting: jsii.Bool(false)})
}

func testConfig() stacks.Config {
	cfg := stacks.DefaultConfig()
	cfg.AssetDir = assetDir
	return cfg
}

func toTemplate(st awscdk.Stack) template {
	return template(*assertions.Template_FromStack(st, nil).ToJSON())
}

var (
	awsOnce, localOnce sync.Once
	awsSynth           synthesised
	localSynth         synthesised
	awsErr, localErr   error
)

// awsStacks synthesises the AWS pair once, with cdk-nag applied.
func awsStacks(t *testing.T) *synthesised {
	t.Helper()
	awsOnce.Do(func() {
		// With cdk-nag errors, synthesis itself fails (a policy-validation
		// report): turn the panic into an error naming the findings.
		defer func() {
			if r := recover(); r != nil {
				awsErr = synthFailure(r)
			}
		}()
		app := newApp(t)
		s, err := stacks.Build(app, testConfig(), false, nil)
		if err != nil {
			awsErr = err
			return
		}
		awsSynth.stateful = toTemplate(s.Stateful.Stack)
		awsSynth.stateless = toTemplate(s.Stateless.Stack)
		awsSynth.statelessStack = s.Stateless
		for _, st := range []awscdk.Stack{s.Stateful.Stack, s.Stateless.Stack} {
			ann := assertions.Annotations_FromStack(st)
			match := assertions.Match_StringLikeRegexp(jsii.String("AwsSolutions-.*|CdkNagValidationFailure.*"))
			for _, m := range *ann.FindError(jsii.String("*"), match) {
				awsSynth.nagErrors = append(awsSynth.nagErrors, fmt.Sprintf("%s: %v", *m.Id, m.Entry.Data))
			}
			for _, m := range *ann.FindWarning(jsii.String("*"), match) {
				awsSynth.nagWarnings = append(awsSynth.nagWarnings, fmt.Sprintf("%s: %v", *m.Id, m.Entry.Data))
			}
		}
	})
	if awsErr != nil {
		t.Fatal(awsErr)
	}
	return &awsSynth
}

// synthFailure describes a panic of synthesis. cdk-nag errors make synthesis
// fail ("Validation failed"); CDK prints each finding (ERROR AwsSolutions-...)
// with its construct path to stdout, above the test failure.
func synthFailure(r any) error {
	return fmt.Errorf("synthesis failed (cdk-nag findings, if any, are printed above): %v", r)
}

// localStack synthesises the local variant once.
func localStack(t *testing.T) template {
	t.Helper()
	localOnce.Do(func() {
		defer func() {
			if r := recover(); r != nil {
				localErr = synthFailure(r)
			}
		}()
		app := newApp(t)
		s, err := stacks.Build(app, testConfig(), true, nil)
		if err != nil {
			localErr = err
			return
		}
		localSynth.local = toTemplate(s.Local.Stack)
	})
	if localErr != nil {
		t.Fatal(localErr)
	}
	return localSynth.local
}

// functions maps role -> function resource: "dispatcher", "redrive", and
// "consumer:<name>", recognised by their environment.
func functions(t *testing.T, tpl template) map[string]resource {
	t.Helper()
	out := fnsByEnv(tpl)
	want := 2 + len(topology.Default().Consumers)
	if _, ok := out["migration"]; ok {
		want++
	}
	if len(out) != want {
		t.Fatalf("found %d fifobox functions, want %d: %v", len(out), want, keys(out))
	}
	return out
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func queueByName(t *testing.T, tpl template, name string) resource {
	t.Helper()
	for _, q := range tpl.resources("AWS::SQS::Queue") {
		if q.Props["QueueName"] == name {
			return q
		}
	}
	t.Fatalf("no queue named %s", name)
	return resource{}
}

func TestTopicIsFifoFromTopology(t *testing.T) {
	tpl := awsStacks(t).stateless
	top := topology.Default().Topic
	var found bool
	for _, tp := range tpl.resources("AWS::SNS::Topic") {
		if tp.Props["TopicName"] != top.Name {
			continue
		}
		found = true
		if tp.Props["FifoTopic"] != true {
			t.Errorf("FifoTopic = %v", tp.Props["FifoTopic"])
		}
		if tp.Props["ContentBasedDeduplication"] != false {
			t.Errorf("ContentBasedDeduplication = %v, want false (dedup id = event id)", tp.Props["ContentBasedDeduplication"])
		}
		if tp.Props["FifoThroughputScope"] != top.ThroughputScope {
			t.Errorf("FifoThroughputScope = %v, want %s", tp.Props["FifoThroughputScope"], top.ThroughputScope)
		}
	}
	if !found {
		t.Fatalf("no topic %s", top.Name)
	}
}

func TestEveryTopicAndQueueUsesARotatedCMK(t *testing.T) {
	for name, tpl := range map[string]template{"stateless": awsStacks(t).stateless, "local": localStack(t)} {
		keysByID := map[string]bool{}
		for _, k := range tpl.resources("AWS::KMS::Key") {
			if k.Props["EnableKeyRotation"] != true {
				t.Errorf("%s: key %s without rotation", name, k.ID)
			}
			keysByID[k.ID] = true
		}
		for _, typ := range []string{"AWS::SNS::Topic", "AWS::SQS::Queue"} {
			for _, r := range tpl.resources(typ) {
				attr := "KmsMasterKeyId"
				if id := refID(r.Props[attr]); !keysByID[id] {
					t.Errorf("%s: %s %s: KmsMasterKeyId %v is not a customer-managed key of the stack", name, typ, r.ID, r.Props[attr])
				}
			}
		}
	}
}

func TestConsumerQueuesDLQsAndRedrive(t *testing.T) {
	tpl := awsStacks(t).stateless
	fns := functions(t, tpl)
	for _, c := range topology.Default().Consumers {
		t.Run(c.Name, func(t *testing.T) {
			q := queueByName(t, tpl, c.QueueName())
			dlq := queueByName(t, tpl, c.DLQName())
			for _, r := range []resource{q, dlq} {
				if r.Props["FifoQueue"] != true {
					t.Errorf("%s: FifoQueue = %v", r.Props["QueueName"], r.Props["FifoQueue"])
				}
			}
			if got := num(dig(q.Props, "RedrivePolicy", "maxReceiveCount")); got != float64(c.ReceiveLimit()) {
				t.Errorf("maxReceiveCount = %v, want %d", got, c.ReceiveLimit())
			}
			if got := refID(dig(q.Props, "RedrivePolicy", "deadLetterTargetArn")); got != dlq.ID {
				t.Errorf("deadLetterTargetArn -> %s, want %s", got, dlq.ID)
			}
			vis := num(q.Props["VisibilityTimeout"])
			if vis != float64(c.VisibilityTimeoutSeconds) {
				t.Errorf("VisibilityTimeout = %v, want %d (topology)", vis, c.VisibilityTimeoutSeconds)
			}
			fn := fns["consumer:"+c.Name]
			timeout := num(fn.Props["Timeout"])
			if timeout != float64(c.FunctionTimeoutSeconds) {
				t.Errorf("function Timeout = %v, want %d", timeout, c.FunctionTimeoutSeconds)
			}
			if vis < 6*timeout {
				t.Errorf("VisibilityTimeout %v < 6 x function timeout %v", vis, timeout)
			}
		})
	}
}

func TestSubscriptionsRawWithTopologyFilters(t *testing.T) {
	tpl := awsStacks(t).stateless
	subs := tpl.resources("AWS::SNS::Subscription")
	for _, c := range topology.Default().Consumers {
		t.Run(c.Name, func(t *testing.T) {
			q := queueByName(t, tpl, c.QueueName())
			var sub *resource
			for i := range subs {
				if refID(subs[i].Props["Endpoint"]) == q.ID {
					sub = &subs[i]
				}
			}
			if sub == nil {
				t.Fatal("no subscription for the queue")
			}
			if sub.Props["Protocol"] != "sqs" || sub.Props["RawMessageDelivery"] != true {
				t.Errorf("Protocol %v RawMessageDelivery %v, want sqs/true", sub.Props["Protocol"], sub.Props["RawMessageDelivery"])
			}
			if scope, ok := sub.Props["FilterPolicyScope"]; ok && scope != "MessageAttributes" {
				t.Errorf("FilterPolicyScope = %v, want MessageAttributes (the filter is on attributes)", scope)
			}
			var want any
			if fp := c.FilterPolicy(); fp != "" {
				if err := json.Unmarshal([]byte(fp), &want); err != nil {
					t.Fatal(err)
				}
			}
			if got := sub.Props["FilterPolicy"]; !reflect.DeepEqual(got, want) {
				t.Errorf("FilterPolicy = %v, want %v (topology)", got, want)
			}
		})
	}
}

func TestEventSourceMappings(t *testing.T) {
	tpl := awsStacks(t).stateless
	fns := functions(t, tpl)
	esms := tpl.resources("AWS::Lambda::EventSourceMapping")
	if len(esms) != len(topology.Default().Consumers) {
		t.Fatalf("%d event source mappings, want one per consumer", len(esms))
	}
	for _, c := range topology.Default().Consumers {
		t.Run(c.Name, func(t *testing.T) {
			q := queueByName(t, tpl, c.QueueName())
			for _, m := range esms {
				if refID(m.Props["EventSourceArn"]) != q.ID {
					continue
				}
				if refID(m.Props["FunctionName"]) != fns["consumer:"+c.Name].ID {
					t.Errorf("mapping of %s invokes %v", c.QueueName(), m.Props["FunctionName"])
				}
				if bs := num(m.Props["BatchSize"]); bs < 1 || bs > 10 {
					t.Errorf("BatchSize = %v, want 1-10 (FIFO)", m.Props["BatchSize"])
				}
				if _, ok := m.Props["MaximumBatchingWindowInSeconds"]; ok {
					t.Errorf("FIFO mapping has a batching window")
				}
				if rt, _ := m.Props["FunctionResponseTypes"].([]any); len(rt) != 1 || rt[0] != "ReportBatchItemFailures" {
					t.Errorf("FunctionResponseTypes = %v", m.Props["FunctionResponseTypes"])
				}
				if mc := num(dig(m.Props, "ScalingConfig", "MaximumConcurrency")); mc != float64(c.MaxConcurrency) {
					t.Errorf("MaximumConcurrency = %v, want %d", mc, c.MaxConcurrency)
				}
				return
			}
			t.Fatal("no event source mapping for the queue")
		})
	}
}

func TestFunctions(t *testing.T) {
	tpl := awsStacks(t).stateless
	fns := functions(t, tpl)
	roles := map[string]string{}
	for name, f := range fns {
		if f.Props["Runtime"] != "provided.al2023" || f.Props["Handler"] != "bootstrap" {
			t.Errorf("%s: runtime %v handler %v", name, f.Props["Runtime"], f.Props["Handler"])
		}
		if a, _ := f.Props["Architectures"].([]any); len(a) != 1 || a[0] != "arm64" {
			t.Errorf("%s: Architectures = %v", name, f.Props["Architectures"])
		}
		if f.Props["VpcConfig"] == nil {
			t.Errorf("%s: not in the VPC", name)
		}
		env := dig(f.Props, "Environment", "Variables").(map[string]any)
		bin := strings.SplitN(name, ":", 2)[0]
		if name == "migration" {
			// The master user, with its secret, straight to the cluster.
			if env["FIFOBOX_DB_USER"] != nil || env["FIFOBOX_DB_IAM_AUTH"] != nil || env["FIFOBOX_DEFAULT_OPERATION"] != "migrate" {
				t.Errorf("migration: env %v", env)
			}
			if !hasTag(f, stacks.FunctionTag, stacks.FnRedrive) {
				t.Errorf("migration: does not run the redrive bootstrap: %v", f.Props["Tags"])
			}
			continue
		}
		wantEnv := map[string]string{"FIFOBOX_DB_PORT": "5432", "FIFOBOX_DB_NAME": "fifobox", "FIFOBOX_DB_USER": stacks.FunctionDBUsers[bin],
			"FIFOBOX_DB_IAM_AUTH": "true", "FIFOBOX_METRICS_NAMESPACE": "Fifobox"}
		if name == "redrive" {
			// The operations function emits no metrics, so it reads no namespace.
			delete(wantEnv, "FIFOBOX_METRICS_NAMESPACE")
			if _, ok := env["FIFOBOX_METRICS_NAMESPACE"]; ok {
				t.Errorf("redrive: FIFOBOX_METRICS_NAMESPACE set, but nothing in it reads it")
			}
		}
		if !hasTag(f, stacks.FunctionTag, bin) {
			t.Errorf("%s: no %s tag naming its bootstrap: %v", name, stacks.FunctionTag, f.Props["Tags"])
		}
		for k, want := range wantEnv {
			if env[k] != want {
				t.Errorf("%s: %s = %v, want %s", name, k, env[k], want)
			}
		}
		if env["FIFOBOX_DB_HOST"] == nil || env["FIFOBOX_DATABASE_URL"] != nil {
			t.Errorf("%s: want FIFOBOX_DB_HOST (the proxy) and no FIFOBOX_DATABASE_URL", name)
		}
		role := refID(f.Props["Role"])
		if other, dup := roles[role]; dup {
			t.Errorf("%s and %s share role %s", name, other, role)
		}
		roles[role] = name
	}
	d := fns["dispatcher"]
	if num(d.Props["ReservedConcurrentExecutions"]) < 1 {
		t.Errorf("dispatcher without reserved concurrency")
	}
	if to := num(d.Props["Timeout"]); to < 60 || to > 120 {
		t.Errorf("dispatcher timeout %v", to)
	}
	if refID(dig(d.Props, "Environment", "Variables", "FIFOBOX_TOPIC_ARN")) == "" {
		t.Errorf("FIFOBOX_TOPIC_ARN is not the topic: %v", dig(d.Props, "Environment", "Variables", "FIFOBOX_TOPIC_ARN"))
	}
	for _, c := range topology.Default().Consumers {
		env := dig(fns["consumer:"+c.Name].Props, "Environment", "Variables").(map[string]any)
		if refID(env["FIFOBOX_DLQ_URL"]) != queueByName(t, tpl, c.DLQName()).ID {
			t.Errorf("%s: FIFOBOX_DLQ_URL = %v", c.Name, env["FIFOBOX_DLQ_URL"])
		}
		// The handler's retry budget stays far below the redrive policy's
		// backstop, both from the topology.
		if env["FIFOBOX_MAX_RETRIES"] != strconv.Itoa(c.Retries()) || env["FIFOBOX_MAX_RECEIVE_COUNT"] != strconv.Itoa(c.ReceiveLimit()) ||
			c.Retries() != topology.DefaultMaxRetries || c.ReceiveLimit() != topology.DefaultMaxReceiveCount {
			t.Errorf("%s: FIFOBOX_MAX_RETRIES = %v, FIFOBOX_MAX_RECEIVE_COUNT = %v; want %d and %d", c.Name,
				env["FIFOBOX_MAX_RETRIES"], env["FIFOBOX_MAX_RECEIVE_COUNT"], topology.DefaultMaxRetries, topology.DefaultMaxReceiveCount)
		}
	}
	r := dig(fns["redrive"].Props, "Environment", "Variables").(map[string]any)
	if r["FIFOBOX_DEFAULT_OPERATION"] != "status" { // migrate is the migration function's
		t.Errorf("FIFOBOX_DEFAULT_OPERATION = %v", r["FIFOBOX_DEFAULT_OPERATION"])
	}
	// FIFOBOX_QUEUES is a Fn::Join of literal JSON and queue URL refs: join
	// it with "<ref:ID>" placeholders and decode the result.
	var queues map[string]struct {
		QueueURL string `json:"queue_url"`
		DLQURL   string `json:"dlq_url"`
	}
	if err := json.Unmarshal([]byte(joinTemplate(r["FIFOBOX_QUEUES"])), &queues); err != nil {
		t.Fatalf("FIFOBOX_QUEUES %v: %v", r["FIFOBOX_QUEUES"], err)
	}
	if len(queues) != len(topology.Default().Consumers) {
		t.Errorf("FIFOBOX_QUEUES has %d consumers", len(queues))
	}
	for _, c := range topology.Default().Consumers {
		q := queues[c.Name]
		if q.QueueURL != "<ref:"+queueByName(t, tpl, c.QueueName()).ID+">" || q.DLQURL != "<ref:"+queueByName(t, tpl, c.DLQName()).ID+">" {
			t.Errorf("FIFOBOX_QUEUES[%s] = %+v", c.Name, q)
		}
	}
}

func hasTag(r resource, key, value string) bool {
	for _, tag := range list(r.Props["Tags"]) {
		if dig(tag, "Key") == key && dig(tag, "Value") == value {
			return true
		}
	}
	return false
}

// joinTemplate renders {"Fn::Join": ["", [...]]} with refs as "<ref:ID>".
func joinTemplate(v any) string {
	parts, _ := dig(v, "Fn::Join").([]any)
	if len(parts) != 2 {
		s, _ := v.(string)
		return s
	}
	var b strings.Builder
	for _, p := range parts[1].([]any) {
		if s, ok := p.(string); ok {
			b.WriteString(s)
		} else {
			b.WriteString("<ref:" + refID(p) + ">")
		}
	}
	return b.String()
}

// statements returns every policy statement of IAM policies, roles and
// resource policies of a template, tagged with where it came from.
func statements(tpl template) map[string][]map[string]any {
	out := map[string][]map[string]any{}
	add := func(where string, doc any) {
		sts, _ := dig(doc, "Statement").([]any)
		for _, s := range sts {
			out[where] = append(out[where], s.(map[string]any))
		}
	}
	for _, r := range tpl.resources("") {
		switch r.Type {
		case "AWS::IAM::Policy", "AWS::IAM::ManagedPolicy", "AWS::SQS::QueuePolicy", "AWS::SNS::TopicPolicy", "AWS::SecretsManager::ResourcePolicy":
			for _, k := range []string{"PolicyDocument", "ResourcePolicy"} {
				if d, ok := r.Props[k]; ok {
					add(r.ID, d)
				}
			}
		case "AWS::IAM::Role":
			pols, _ := r.Props["Policies"].([]any)
			for _, p := range pols {
				add(r.ID, dig(p, "PolicyDocument"))
			}
		}
	}
	return out
}

func list(v any) []any {
	if l, ok := v.([]any); ok {
		return l
	}
	return []any{v}
}

func TestNoWildcardActionsOnDataResources(t *testing.T) {
	s := awsStacks(t)
	for name, tpl := range map[string]template{"stateful": s.stateful, "stateless": s.stateless, "local": localStack(t)} {
		for where, sts := range statements(tpl) {
			for _, st := range sts {
				if st["Effect"] != "Allow" {
					continue // e.g. the Deny of non-TLS access (enforceSSL)
				}
				anyResource := false
				for _, r := range list(st["Resource"]) {
					if r == "*" {
						anyResource = true
					}
				}
				for _, a := range list(st["Action"]) {
					as, _ := a.(string)
					if as == "*" || strings.HasSuffix(as, ":*") {
						t.Errorf("%s %s: wildcard action %q", name, where, as)
					}
					for _, data := range []string{"sqs:", "sns:", "kms:", "rds-db:", "secretsmanager:", "rds:"} {
						if anyResource && strings.HasPrefix(as, data) {
							t.Errorf("%s %s: %s on Resource \"*\"", name, where, as)
						}
					}
				}
			}
		}
	}
}

func TestLeastPrivilegeGrants(t *testing.T) {
	tpl := awsStacks(t).stateless
	fns := functions(t, tpl)
	sts := statements(tpl)
	actionsOf := func(fn resource) map[string]bool {
		role := refID(fn.Props["Role"])
		out := map[string]bool{}
		for _, p := range tpl.resources("AWS::IAM::Policy") {
			attached := false
			for _, r := range list(p.Props["Roles"]) {
				if refID(r) == role {
					attached = true
				}
			}
			if !attached {
				continue
			}
			for _, st := range sts[p.ID] {
				for _, a := range list(st["Action"]) {
					out[a.(string)] = true
				}
			}
		}
		return out
	}
	for name, fn := range fns {
		acts := actionsOf(fn)
		if name == "migration" {
			// The master user's secret, no IAM database login, nothing else.
			if acts["rds-db:connect"] || !acts["secretsmanager:GetSecretValue"] || acts["sqs:SendMessage"] || acts["sns:Publish"] {
				t.Errorf("migration: actions %v", keys(acts))
			}
			continue
		}
		if !acts["rds-db:connect"] {
			t.Errorf("%s: no rds-db:connect", name)
		}
		if acts["secretsmanager:GetSecretValue"] {
			t.Errorf("%s: reads a secret", name)
		}
		if acts["sns:Publish"] != (name == "dispatcher") {
			t.Errorf("%s: sns:Publish = %v", name, acts["sns:Publish"])
		}
		if strings.HasPrefix(name, "consumer:") && (!acts["sqs:ReceiveMessage"] || !acts["sqs:DeleteMessage"] || !acts["sqs:SendMessage"]) {
			t.Errorf("%s: consumer lacks receive/delete/send: %v", name, keys(acts))
		}
		if name == "dispatcher" && (acts["sqs:SendMessage"] || acts["sqs:ReceiveMessage"]) {
			t.Errorf("dispatcher can use SQS: %v", keys(acts))
		}
	}
	// rds-db:connect is scoped to the proxy's dbuser ARN of the function's
	// own user (each role's policy names exactly one user).
	for name, fn := range fns {
		if name == "migration" {
			continue
		}
		role := refID(fn.Props["Role"])
		want := "/" + stacks.FunctionDBUsers[strings.SplitN(name, ":", 2)[0]]
		for _, p := range tpl.resources("AWS::IAM::Policy") {
			attached := false
			for _, r := range list(p.Props["Roles"]) {
				attached = attached || refID(r) == role
			}
			for _, st := range sts[p.ID] {
				if !attached || st["Action"] != "rds-db:connect" {
					continue
				}
				b, _ := json.Marshal(st["Resource"])
				if !strings.Contains(string(b), want+`"`) {
					t.Errorf("%s: rds-db:connect on %s, want its own user %s", name, b, want[1:])
				}
			}
		}
	}
	for where, ss := range sts {
		for _, st := range ss {
			if st["Action"] != "rds-db:connect" {
				continue
			}
			b, _ := json.Marshal(st["Resource"])
			if !strings.Contains(string(b), ":dbuser:") || !strings.Contains(string(b), "/fifobox") {
				t.Errorf("%s: rds-db:connect on %s", where, b)
			}
		}
	}
}

// scheduleFor returns the one schedule whose target is fn.
func scheduleFor(t *testing.T, tpl template, fn resource) map[string]any {
	t.Helper()
	var found []map[string]any
	for _, s := range tpl.resources("AWS::Scheduler::Schedule") {
		if refID(dig(s.Props, "Target", "Arn")) == fn.ID {
			found = append(found, s.Props)
		}
	}
	if len(found) != 1 {
		t.Fatalf("%d schedules target %s, want 1", len(found), fn.ID)
	}
	return found[0]
}

func TestDispatcherSchedule(t *testing.T) {
	tpl := awsStacks(t).stateless
	fns := functions(t, tpl)
	if n := len(tpl.resources("AWS::Scheduler::Schedule")); n != 2 {
		t.Fatalf("%d schedules, want the dispatcher's and the retention one", n)
	}
	s := scheduleFor(t, tpl, fns["dispatcher"])
	if s["ScheduleExpression"] != "rate(1 minute)" {
		t.Errorf("ScheduleExpression = %v", s["ScheduleExpression"])
	}
	dlq := tpl.resource(refID(dig(s, "Target", "DeadLetterConfig", "Arn")))
	if dlq.Type != "AWS::SQS::Queue" {
		t.Fatalf("schedule has no SQS DLQ: %v", dig(s, "Target", "DeadLetterConfig"))
	}
	if dlq.Props["FifoQueue"] == true || dlq.Props["KmsMasterKeyId"] == nil {
		t.Errorf("schedule DLQ must be a standard, encrypted queue: %v", dlq.Props)
	}
	if num(dig(s, "Target", "RetryPolicy", "MaximumRetryAttempts")) < 1 {
		t.Errorf("RetryPolicy = %v", dig(s, "Target", "RetryPolicy"))
	}
	// Lambda's own async retries are off: the next tick is the retry.
	var cfg *resource
	for _, c := range tpl.resources("AWS::Lambda::EventInvokeConfig") {
		if refID(c.Props["FunctionName"]) == fns["dispatcher"].ID {
			cfg = &c
		}
	}
	if cfg == nil || num(cfg.Props["MaximumRetryAttempts"]) != 0 {
		t.Errorf("dispatcher async retries not disabled")
	}
}

// A daily schedule runs the redrive function's prune with the configured
// retentions; the inbox keeps rows longer than the DLQs keep messages.
func TestRetentionSchedule(t *testing.T) {
	tpl := awsStacks(t).stateless
	fns := functions(t, tpl)
	s := scheduleFor(t, tpl, fns["redrive"])
	if s["ScheduleExpression"] != "cron(17 3 * * ? *)" {
		t.Errorf("ScheduleExpression = %v, want daily at 03:17", s["ScheduleExpression"])
	}
	var input map[string]any
	if err := json.Unmarshal([]byte(fmt.Sprint(dig(s, "Target", "Input"))), &input); err != nil {
		t.Fatalf("target input %v: %v", dig(s, "Target", "Input"), err)
	}
	cfg := stacks.DefaultConfig()
	if input["operation"] != "prune" || input["older_than"] != cfg.OutboxRetention || input["inbox_older_than"] != cfg.InboxRetention {
		t.Errorf("target input %v, want prune with %s and %s", input, cfg.OutboxRetention, cfg.InboxRetention)
	}
	if d, _ := time.ParseDuration(cfg.InboxRetention); d <= stacks.DLQRetentionDays*24*time.Hour {
		t.Errorf("inbox retention %s does not outlast the DLQs' %d days", cfg.InboxRetention, stacks.DLQRetentionDays)
	}
	if tpl.resource(refID(dig(s, "Target", "DeadLetterConfig", "Arn"))).Type != "AWS::SQS::Queue" {
		t.Errorf("retention schedule has no DLQ: %v", dig(s, "Target", "DeadLetterConfig"))
	}
}

func TestMigrationTriggerInvokesRedrive(t *testing.T) {
	tpl := awsStacks(t).stateless
	fns := functions(t, tpl)
	triggers := tpl.resources("Custom::Trigger")
	if len(triggers) != 1 {
		t.Fatalf("%d triggers", len(triggers))
	}
	// The trigger invokes the migration function's current version (the
	// master user's); the operations function cannot migrate.
	handler := tpl.resource(refID(triggers[0].Props["HandlerArn"]))
	if handler.Type != "AWS::Lambda::Version" || refID(handler.Props["FunctionName"]) != fns["migration"].ID {
		t.Errorf("trigger HandlerArn %v is not a version of the migration function", triggers[0].Props["HandlerArn"])
	}
	if op := dig(fns["redrive"].Props, "Environment", "Variables", "FIFOBOX_DEFAULT_OPERATION"); op != "status" {
		t.Errorf("operations function's default operation %v, want status", op)
	}
	if triggers[0].Props["InvocationType"] != "RequestResponse" {
		t.Errorf("InvocationType = %v: the deploy must wait for the migration", triggers[0].Props["InvocationType"])
	}
}

func TestDatabaseAndProxy(t *testing.T) {
	tpl := awsStacks(t).stateful
	proxies := tpl.resources("AWS::RDS::DBProxy")
	if len(proxies) != 1 {
		t.Fatalf("%d proxies", len(proxies))
	}
	p := proxies[0].Props
	if p["RequireTLS"] != true {
		t.Errorf("RequireTLS = %v", p["RequireTLS"])
	}
	// End-to-end IAM: no secret (no password) for any function's user.
	if p["DefaultAuthScheme"] != "IAM_AUTH" {
		t.Errorf("DefaultAuthScheme = %v, want IAM_AUTH", p["DefaultAuthScheme"])
	}
	for _, a := range list(p["Auth"]) {
		if dig(a, "SecretArn") != nil {
			t.Errorf("proxy logs in with a secret: %v", a)
		}
	}
	// The proxy's role may log in as exactly the functions' users.
	b, _ := json.Marshal(tpl.resources("AWS::IAM::Policy"))
	for _, u := range stacks.FunctionDBUsers {
		if !strings.Contains(string(b), "/"+u) {
			t.Errorf("no rds-db:connect for the proxy as %s", u)
		}
	}
	clusters := tpl.resources("AWS::RDS::DBCluster")
	if len(clusters) != 1 {
		t.Fatalf("%d clusters", len(clusters))
	}
	c := clusters[0].Props
	if c["Engine"] != "aurora-postgresql" || c["StorageEncrypted"] != true || c["DeletionProtection"] != true {
		t.Errorf("cluster engine %v encrypted %v deletion protection %v", c["Engine"], c["StorageEncrypted"], c["DeletionProtection"])
	}
	if dig(c, "ServerlessV2ScalingConfiguration", "MinCapacity") == nil {
		t.Errorf("not Serverless v2: %v", c["ServerlessV2ScalingConfiguration"])
	}
	for _, i := range tpl.resources("AWS::RDS::DBInstance") {
		if i.Props["DBInstanceClass"] != "db.serverless" || i.Props["PubliclyAccessible"] != false {
			t.Errorf("instance %s: class %v public %v", i.ID, i.Props["DBInstanceClass"], i.Props["PubliclyAccessible"])
		}
	}
	if len(tpl.resources("AWS::SecretsManager::RotationSchedule")) != 1 {
		t.Errorf("generated secret is not rotated")
	}
}

func TestNetwork(t *testing.T) {
	tpl := awsStacks(t).stateful
	for _, typ := range []string{"AWS::EC2::InternetGateway", "AWS::EC2::NatGateway"} {
		if n := len(tpl.resources(typ)); n != 0 {
			t.Errorf("%d %s: the VPC should have isolated subnets only", n, typ)
		}
	}
	for _, s := range tpl.resources("AWS::EC2::Subnet") {
		if s.Props["MapPublicIpOnLaunch"] == true {
			t.Errorf("public subnet %s", s.ID)
		}
	}
	if len(tpl.resources("AWS::EC2::FlowLog")) == 0 {
		t.Errorf("no VPC flow log")
	}
	services := map[string]bool{}
	for _, e := range tpl.resources("AWS::EC2::VPCEndpoint") {
		b, _ := json.Marshal(e.Props["ServiceName"])
		for _, svc := range []string{"sns", "sqs", "secretsmanager"} {
			if strings.Contains(string(b), "."+svc+`"`) {
				services[svc] = true
			}
		}
	}
	if len(services) != 3 {
		t.Errorf("interface endpoints for %v, want sns, sqs, secretsmanager", keys(services))
	}
	// The functions' group may reach the proxy on 5432.
	ok := false
	for _, in := range tpl.resources("AWS::EC2::SecurityGroupIngress") {
		if num(in.Props["FromPort"]) == 5432 && strings.Contains(refID(in.Props["SourceSecurityGroupId"]), "FunctionSecurityGroup") &&
			strings.Contains(refID(in.Props["GroupId"]), "ProxySecurityGroup") {
			ok = true
		}
	}
	if !ok {
		t.Errorf("no ingress from the function security group to the proxy on 5432")
	}
}

func TestAlarms(t *testing.T) {
	tpl := awsStacks(t).stateless
	th := stacks.DefaultThresholds()
	type want struct {
		metric           string
		threshold        float64
		missing          string
		period           float64 // seconds
		datapoints, over float64 // fires on datapoints breaching out of over
	}
	// Alarms that fire below their threshold (free memory, free storage).
	below := map[string]bool{stacks.AlarmAuroraFreeableMemory: true, stacks.AlarmAuroraLocalStorage: true}
	const breaching, ignore, notBreaching = "breaching", "ignore", "notBreaching"
	wants := map[string]want{
		stacks.AlarmPublishLag:        {stacks.MetricOldestDueAgeSeconds, th.PublishLagSeconds, breaching, 60, 3, 3},
		stacks.AlarmDueBacklog:        {stacks.MetricDueEvents, th.DueBacklog, breaching, 60, 3, 3},
		stacks.AlarmPublishRetrying:   {stacks.MetricRetryingAggregates, th.RetryingAggregates, ignore, 60, 5, 5},
		stacks.AlarmBackingOffEvents:  {stacks.MetricBackingOffEvents, th.BackingOffEvents, ignore, 60, 5, 5},
		stacks.AlarmDeadEvents:        {stacks.MetricDeadEvents, th.DeadEvents, ignore, 300, 1, 1},
		stacks.AlarmParkedAggregates:  {stacks.MetricParkedAggregates, th.ParkedAggregates, ignore, 300, 1, 1},
		stacks.AlarmParkedEvents:      {stacks.MetricParkedEvents, th.ParkedEvents, ignore, 300, 1, 1},
		stacks.AlarmStrandedEvents:    {stacks.MetricStrandedEvents, th.StrandedEvents, ignore, 300, 1, 1},
		stacks.AlarmDispatcherErrors:  {"Errors", th.DispatcherErrors, notBreaching, 300, 1, 1},
		stacks.AlarmDispatcherThrottl: {"Throttles", th.DispatcherThrottles, notBreaching, 300, 1, 1},
		stacks.AlarmScheduleDLQ:       {"ApproximateNumberOfMessagesVisible", th.ScheduleDLQVisibleMessages, notBreaching, 300, 1, 1},
		stacks.AlarmOperationsErrors:  {"Errors", th.OperationsErrors, notBreaching, 300, 1, 1},
		stacks.AlarmDeliveryFailed:    {"NumberOfNotificationsFailed", th.DeliveryFailures, notBreaching, 300, 1, 1},
		stacks.AlarmDeliveryLost:      {"NumberOfNotificationsFailedToRedriveToDlq", th.DeliveryLost, notBreaching, 300, 1, 1},
	}
	// The stateful side and the outbox's long-transaction and unrouted
	// alarms. Default max_connections at 4 ACU is 901; 80 % of it is 720.
	for name, w := range map[string]want{
		stacks.AlarmOldestTransaction:    {stacks.MetricOldestTransactionAgeSeconds, th.OldestTransactionAgeSeconds, notBreaching, 60, 3, 3},
		stacks.AlarmUnroutedEvents:       {stacks.MetricUnroutedEvents, th.UnroutedEvents, notBreaching, 300, 1, 1},
		stacks.AlarmAuroraCPU:            {"CPUUtilization", th.AuroraCPUPercent, breaching, 300, 3, 3},
		stacks.AlarmAuroraFreeableMemory: {"FreeableMemory", th.AuroraFreeableMemoryBytes, breaching, 300, 3, 3},
		stacks.AlarmAuroraConnections:    {"DatabaseConnections", 720, breaching, 300, 2, 2},
		stacks.AlarmAuroraDeadlocks:      {"Deadlocks", th.AuroraDeadlocks, notBreaching, 300, 1, 1},
		stacks.AlarmAuroraLocalStorage:   {"FreeLocalStorage", th.AuroraFreeLocalStorageBytes, breaching, 300, 1, 1},
		stacks.AlarmAuroraTransactionIDs: {"MaximumUsedTransactionIDs", th.AuroraTransactionIDs, notBreaching, 300, 1, 1},
		stacks.AlarmProxyClientConns:     {"ClientConnections", th.ProxyClientConnections, notBreaching, 300, 2, 2},
		stacks.AlarmProxyPinned:          {"DatabaseConnectionsCurrentlySessionPinned", th.ProxyPinnedSessions, notBreaching, 300, 3, 3},
		stacks.AlarmProxyBorrowLatency:   {"DatabaseConnectionsBorrowLatency", th.ProxyBorrowLatencyMicros, notBreaching, 300, 3, 3},
	} {
		wants[name] = w
	}
	for _, c := range topology.Default().Consumers {
		// One late batch in 5 minutes fires the lag alarm, so a consumer that
		// processes a batch an hour can alarm too.
		wants[stacks.AlarmConsumerLag+"-"+c.Name] = want{stacks.MetricConsumerLagSeconds, th.ConsumerLagSeconds, notBreaching, 300, 1, 1}
		wants[stacks.AlarmConsumerFailures+"-"+c.Name] = want{stacks.MetricFailures, th.ConsumerFailures, notBreaching, 300, 1, 1}
		wants[stacks.AlarmConsumerErrors+"-"+c.Name] = want{"Errors", th.ConsumerErrors, notBreaching, 300, 1, 1}
		wants[stacks.AlarmConsumerThrottles+"-"+c.Name] = want{"Throttles", th.ConsumerThrottles, notBreaching, 300, 1, 1}
		wants[stacks.AlarmQueueAge+"-"+c.Name] = want{"ApproximateAgeOfOldestMessage", th.QueueOldestMessageAgeSeconds, notBreaching, 60, 3, 3}
		wants[stacks.AlarmDLQMessages+"-"+c.Name] = want{"ApproximateNumberOfMessagesVisible", th.DLQVisibleMessages, notBreaching, 300, 1, 1}
		wants[stacks.AlarmSubscriptionDLQ+"-"+c.Name] = want{"ApproximateNumberOfMessagesVisible", th.DLQVisibleMessages, notBreaching, 300, 1, 1}
	}
	var alarmTopic string
	for _, tp := range tpl.resources("AWS::SNS::Topic") {
		if tp.Props["FifoTopic"] == nil {
			alarmTopic = tp.ID
		}
	}
	got := map[string]resource{}
	for _, a := range tpl.resources("AWS::CloudWatch::Alarm") {
		got[strings.TrimPrefix(a.Props["AlarmName"].(string), "Fifobox-")] = a
	}
	for _, name := range keys(wants) {
		w := wants[name]
		a, ok := got[name]
		if !ok {
			t.Errorf("alarm %s missing", name)
			continue
		}
		p := a.Props
		cmp := "GreaterThanThreshold"
		if below[name] {
			cmp = "LessThanThreshold"
		}
		if p["MetricName"] != w.metric || num(p["Threshold"]) != w.threshold || p["ComparisonOperator"] != cmp ||
			p["TreatMissingData"] != w.missing || num(p["Period"]) != w.period || num(p["DatapointsToAlarm"]) != w.datapoints ||
			num(p["EvaluationPeriods"]) != w.over {
			t.Errorf("alarm %s: %v > %v over %vs, %v of %v, missing %v; want %s > %v over %vs, %v of %v, missing %s", name,
				p["MetricName"], p["Threshold"], p["Period"], p["DatapointsToAlarm"], p["EvaluationPeriods"], p["TreatMissingData"],
				w.metric, w.threshold, w.period, w.datapoints, w.over, w.missing)
		}
		for _, k := range []string{"AlarmActions", "OKActions"} {
			if acts := list(p[k]); len(acts) != 1 || refID(acts[0]) != alarmTopic {
				t.Errorf("alarm %s: %s %v, want the alarm topic %s", name, k, p[k], alarmTopic)
			}
		}
		if d, _ := p["AlarmDescription"].(string); len(d) < 30 {
			t.Errorf("alarm %s: description %q does not say what it means", name, d)
		}
	}
	for name := range got {
		if _, ok := wants[name]; !ok {
			t.Errorf("unexpected alarm %s", name)
		}
	}
	// EMF metrics carry the dimensions pkg/metrics emits.
	for _, name := range []string{stacks.AlarmPublishLag, stacks.AlarmPublishRetrying, stacks.AlarmConsumerLag + "-audit"} {
		a := got[name]
		if a.Props["Namespace"] != "Fifobox" || len(list(a.Props["Dimensions"])) != 1 {
			t.Errorf("alarm %s: namespace %v dimensions %v", name, a.Props["Namespace"], a.Props["Dimensions"])
		}
	}
	// The outbox gauge has the dispatcher's dimension, like the others.
	if a := got[stacks.AlarmOldestTransaction]; a.Props["Namespace"] != "Fifobox" || joinTemplate(a.Props["Dimensions"]) != joinTemplate([]any{map[string]any{"Name": "Service", "Value": "dispatcher"}}) {
		t.Errorf("alarm %s: namespace %v dimensions %v, want Fifobox Service=dispatcher", stacks.AlarmOldestTransaction, a.Props["Namespace"], a.Props["Dimensions"])
	}
	// Aurora's alarms watch the cluster, the proxy's the proxy (both in the
	// stateful stack: imported values).
	for name, dim := range map[string]string{stacks.AlarmAuroraCPU: "DBClusterIdentifier", stacks.AlarmAuroraDeadlocks: "DBClusterIdentifier",
		stacks.AlarmProxyPinned: "ProxyName", stacks.AlarmProxyBorrowLatency: "ProxyName"} {
		a := got[name]
		dims := list(a.Props["Dimensions"])
		if a.Props["Namespace"] != "AWS/RDS" || len(dims) != 1 || dig(dims[0], "Name") != dim || !strings.Contains(asJSON(dig(dims[0], "Value")), "Fn::GetStackOutput") {
			t.Errorf("alarm %s: namespace %v dimensions %v, want AWS/RDS by the stateful stack's %s", name, a.Props["Namespace"], dims, dim)
		}
	}
	// The unrouted-events metric counts the dispatcher's log lines.
	filters := tpl.resources("AWS::Logs::MetricFilter")
	if len(filters) != 1 {
		t.Fatalf("%d metric filters, want the unrouted-events one", len(filters))
	}
	f := filters[0].Props
	mt := list(f["MetricTransformations"])
	if f["FilterPattern"] != `{ $.msg = "`+stacks.UnroutedLogMessage+`" }` || len(mt) != 1 || dig(mt[0], "MetricName") != stacks.MetricUnroutedEvents ||
		dig(mt[0], "MetricValue") != "$.unrouted" || dig(mt[0], "MetricNamespace") != "Fifobox" {
		t.Errorf("unrouted metric filter %v", f)
	}
	if lg := refID(f["LogGroupName"]); lg == "" || refID(dig(functions(t, tpl)["dispatcher"].Props, "LoggingConfig", "LogGroup")) != lg {
		t.Errorf("unrouted metric filter on log group %v, want the dispatcher's", f["LogGroupName"])
	}

	// The SNS delivery alarms watch the events topic.
	for _, name := range []string{stacks.AlarmDeliveryFailed, stacks.AlarmDeliveryLost} {
		a := got[name]
		dims := list(a.Props["Dimensions"])
		if a.Props["Namespace"] != "AWS/SNS" || len(dims) != 1 || dig(dims[0], "Name") != "TopicName" {
			t.Errorf("alarm %s: namespace %v dimensions %v, want AWS/SNS by TopicName", name, a.Props["Namespace"], dims)
		}
	}
}

func TestDashboardShowsTheSignals(t *testing.T) {
	tpl := awsStacks(t).stateless
	ds := tpl.resources("AWS::CloudWatch::Dashboard")
	if len(ds) != 1 {
		t.Fatalf("%d dashboards", len(ds))
	}
	body := joinTemplate(ds[0].Props["DashboardBody"])
	var parsed struct {
		Widgets []struct {
			Type       string         `json:"type"`
			Properties map[string]any `json:"properties"`
		} `json:"widgets"`
	}
	if err := json.Unmarshal([]byte(body), &parsed); err != nil {
		t.Fatalf("dashboard body: %v", err)
	}
	if len(parsed.Widgets) == 0 || parsed.Widgets[0].Type != "alarm" {
		t.Fatalf("first widget is not the alarm status")
	}
	if n, want := len(list(parsed.Widgets[0].Properties["alarms"])), len(tpl.resources("AWS::CloudWatch::Alarm")); n != want {
		t.Errorf("alarm widget shows %d alarms, want all %d", n, want)
	}
	for _, m := range []string{stacks.MetricOutboxBacklog, stacks.MetricOldestPendingAgeSeconds, stacks.MetricDeadEvents, stacks.MetricParkedAggregates,
		stacks.MetricDueEvents, stacks.MetricBackingOffEvents, stacks.MetricParkedEvents, stacks.MetricOldestDueAgeSeconds, stacks.MetricRetryingAggregates,
		stacks.MetricConsumerLagSeconds, stacks.MetricFailures, "ApproximateAgeOfOldestMessage", "ApproximateNumberOfMessagesVisible", "Throttles",
		"NumberOfNotificationsFailed", "NumberOfNotificationsFailedToRedriveToDlq"} {
		if !strings.Contains(body, `"`+m+`"`) {
			t.Errorf("dashboard lacks %s", m)
		}
	}
}

func TestCdkNagAwsSolutions(t *testing.T) {
	s := awsStacks(t)
	for _, e := range s.nagErrors {
		t.Errorf("cdk-nag error: %s", e)
	}
	for _, w := range s.nagWarnings {
		t.Errorf("cdk-nag warning: %s", w)
	}
	// Every suppression carries a written reason.
	n := 0
	for name, tpl := range map[string]template{"stateful": s.stateful, "stateless": s.stateless} {
		for _, r := range tpl.resources("") {
			sup, _ := dig(r.Meta, "cdk_nag", "rules_to_suppress").([]any)
			for _, x := range sup {
				n++
				id, _ := dig(x, "id").(string)
				reason, _ := dig(x, "reason").(string)
				if len(reason) < 40 {
					t.Errorf("%s %s: suppression %s without a real reason: %q", name, r.ID, id, reason)
				}
				if testing.Verbose() {
					t.Logf("suppressed %s on %s %s: %s", id, name, r.ID, reason)
				}
			}
		}
	}
	if n == 0 {
		t.Errorf("no suppressions found in template metadata: is cdk-nag applied?")
	}
}

func TestLocalVariant(t *testing.T) {
	tpl := localStack(t)
	for _, r := range tpl.resources("") {
		if strings.HasPrefix(r.Type, "AWS::EC2::") || strings.HasPrefix(r.Type, "AWS::RDS::") || strings.HasPrefix(r.Type, "AWS::SecretsManager::") {
			t.Errorf("local variant has %s %s", r.Type, r.ID)
		}
	}
	fns := functions(t, tpl)
	for name, f := range fns {
		env := dig(f.Props, "Environment", "Variables").(map[string]any)
		if env["FIFOBOX_DATABASE_URL"] != stacks.DefaultConfig().DatabaseURL || env["FIFOBOX_DB_HOST"] != nil {
			t.Errorf("%s: FIFOBOX_DATABASE_URL %v FIFOBOX_DB_HOST %v", name, env["FIFOBOX_DATABASE_URL"], env["FIFOBOX_DB_HOST"])
		}
		if f.Props["VpcConfig"] != nil {
			t.Errorf("%s: in a VPC", name)
		}
	}
	for _, c := range topology.Default().Consumers {
		queueByName(t, tpl, c.QueueName())
		queueByName(t, tpl, c.DLQName())
		queueByName(t, tpl, c.SubscriptionDLQName())
	}
	if len(tpl.resources("AWS::Lambda::EventSourceMapping")) != len(topology.Default().Consumers) ||
		len(tpl.resources("AWS::Scheduler::Schedule")) != 2 || len(tpl.resources("Custom::Trigger")) != 1 {
		t.Errorf("local variant lacks mappings, schedule or migration trigger")
	}
}

func TestConfigValidation(t *testing.T) {
	cfg := testConfig()
	cfg.AssetDir = t.TempDir()
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "make build") {
		t.Errorf("missing bootstrap: err = %v", err)
	}
	for _, prefix := range []string{"", "9lives", "my_app", strings.Repeat("x", 80)} {
		cfg = testConfig()
		cfg.Prefix = prefix
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "prefix") {
			t.Errorf("prefix %q: err = %v, want one naming the prefix", prefix, err)
		}
	}
	cfg = testConfig()
	cfg.Topology.Consumers[0].VisibilityTimeoutSeconds = 5 * cfg.Topology.Consumers[0].FunctionTimeoutSeconds
	if err := cfg.Validate(); err == nil {
		t.Errorf("visibility timeout below 6x the function timeout accepted")
	}
	for _, c := range []struct{ outbox, inbox, field string }{
		{"a week", "720h", "outbox retention"},
		{"0s", "720h", "outbox retention"},
		{"168h", "336h", "inbox retention"}, // exactly the DLQs' 14 days: a redriven message could outlive its inbox row
		{"168h", "30d", "inbox retention"},
	} {
		cfg = testConfig()
		cfg.OutboxRetention, cfg.InboxRetention = c.outbox, c.inbox
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), c.field) {
			t.Errorf("retentions %q, %q: err = %v, want one naming the %s", c.outbox, c.inbox, err, c.field)
		}
	}
}

// A second deployment in the same account (another prefix) must not share a
// topic, queue or metrics namespace with the first: CloudFormation would
// refuse the names, or, for metrics, each deployment's alarms would watch
// the other's dispatcher. The default prefix keeps the topology's names.
func TestSecondDeploymentNamesAreItsOwn(t *testing.T) {
	app := newApp(t)
	cfg := testConfig()
	cfg.Prefix = "Staging"
	s, err := stacks.Build(app, cfg, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	staging, def := toTemplate(s.Stateless.Stack), awsStacks(t).stateless
	top := topology.Default()
	names := func(tpl template, typ, prop string) map[string]bool {
		out := map[string]bool{}
		for _, r := range tpl.resources(typ) {
			if n, ok := r.Props[prop].(string); ok {
				out[n] = true
			}
		}
		return out
	}
	wantTopics := map[string]bool{"staging-" + top.Topic.Name: true}
	wantQueues, defQueues := map[string]bool{}, map[string]bool{}
	for _, c := range top.Consumers {
		for _, q := range []string{c.QueueName(), c.DLQName(), c.SubscriptionDLQName()} {
			wantQueues["staging-"+q] = true
			defQueues[q] = true
		}
	}
	if got := names(staging, "AWS::SNS::Topic", "TopicName"); !reflect.DeepEqual(got, wantTopics) {
		t.Errorf("Staging topic names %v, want %v", keys(got), keys(wantTopics))
	}
	if got := names(staging, "AWS::SQS::Queue", "QueueName"); !reflect.DeepEqual(got, wantQueues) {
		t.Errorf("Staging queue names %v, want %v", keys(got), keys(wantQueues))
	}
	if got := names(def, "AWS::SQS::Queue", "QueueName"); !reflect.DeepEqual(got, defQueues) {
		t.Errorf("default queue names %v, want the topology's %v", keys(got), keys(defQueues))
	}
	for name, f := range functions(t, staging) {
		if name == "redrive" || name == "migration" {
			continue // emit no metrics
		}
		if ns := dig(f.Props, "Environment", "Variables", "FIFOBOX_METRICS_NAMESPACE"); ns != "Fifobox/Staging" {
			t.Errorf("%s: FIFOBOX_METRICS_NAMESPACE = %v, want Fifobox/Staging", name, ns)
		}
	}
	for _, a := range staging.resources("AWS::CloudWatch::Alarm") {
		name, _ := a.Props["AlarmName"].(string)
		if !strings.HasPrefix(name, "Staging-") {
			t.Errorf("alarm %s lacks the prefix", name)
		}
		if ns, ok := a.Props["Namespace"].(string); ok && strings.HasPrefix(ns, "Fifobox") && ns != "Fifobox/Staging" {
			t.Errorf("alarm %s reads namespace %s, want Fifobox/Staging", name, ns)
		}
	}
}

// An existing RDS Proxy (context dbProxy*) replaces Aurora and the proxy;
// this path needs no lookups, so it synthesises offline too.
func TestExistingProxy(t *testing.T) {
	app := newApp(t)
	cfg := testConfig()
	cfg.ExistingProxy = &stacks.ProxyAttributes{
		Arn:             "arn:aws:rds:eu-west-1:123456789012:db-proxy:prx-0123456789abcdef0",
		Name:            "shared-proxy",
		Endpoint:        "shared-proxy.proxy-abc.eu-west-1.rds.amazonaws.com",
		SecurityGroupID: "sg-0123456789abcdef0",
	}
	s, err := stacks.Build(app, cfg, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	stateful, stateless := toTemplate(s.Stateful.Stack), toTemplate(s.Stateless.Stack)
	for _, typ := range []string{"AWS::RDS::DBCluster", "AWS::RDS::DBProxy", "AWS::SecretsManager::Secret"} {
		if n := len(stateful.resources(typ)); n != 0 {
			t.Errorf("%d %s with an existing proxy", n, typ)
		}
	}
	ok := false
	for _, in := range stateful.resources("AWS::EC2::SecurityGroupIngress") {
		if in.Props["GroupId"] == "sg-0123456789abcdef0" && num(in.Props["FromPort"]) == 5432 {
			ok = true
		}
	}
	if !ok {
		t.Errorf("no ingress rule on the existing proxy's security group")
	}
	for name, f := range functions(t, stateless) {
		if h := dig(f.Props, "Environment", "Variables", "FIFOBOX_DB_HOST"); h != cfg.ExistingProxy.Endpoint {
			t.Errorf("%s: FIFOBOX_DB_HOST = %v", name, h)
		}
	}
	b, _ := json.Marshal(statements(stateless))
	if !strings.Contains(string(b), "dbuser:") || !strings.Contains(string(b), "prx-0123456789abcdef0") {
		t.Errorf("rds-db:connect is not scoped to the existing proxy")
	}
}

// Every consumer's SNS subscription dead-letters what SNS cannot deliver to
// a FIFO queue of its own (a FIFO topic's subscription DLQ must be FIFO),
// which only this topic's SNS may send to, encrypted with a key SNS may use
// on behalf of this topic only.
func TestSubscriptionDeadLetterQueues(t *testing.T) {
	for variant, tpl := range map[string]template{"stateless": awsStacks(t).stateless, "local": localStack(t)} {
		t.Run(variant, func(t *testing.T) {
			topic := ""
			for _, tp := range tpl.resources("AWS::SNS::Topic") {
				if tp.Props["FifoTopic"] == true {
					topic = tp.ID
				}
			}
			subs := tpl.resources("AWS::SNS::Subscription")
			for _, c := range topology.Default().Consumers {
				dlq := queueByName(t, tpl, c.SubscriptionDLQName())
				q := queueByName(t, tpl, c.QueueName())
				if dlq.Props["FifoQueue"] != true || num(dlq.Props["MessageRetentionPeriod"]) != stacks.DLQRetentionDays*86400 {
					t.Errorf("%s: FifoQueue %v retention %v, want a FIFO queue keeping messages %d days", c.Name, dlq.Props["FifoQueue"], dlq.Props["MessageRetentionPeriod"], stacks.DLQRetentionDays)
				}
				found := false
				for _, s := range subs {
					if refID(s.Props["Endpoint"]) != q.ID {
						continue
					}
					found = true
					if got := refID(dig(s.Props, "RedrivePolicy", "deadLetterTargetArn")); got != dlq.ID {
						t.Errorf("%s: subscription RedrivePolicy -> %v, want %s", c.Name, s.Props["RedrivePolicy"], dlq.ID)
					}
				}
				if !found {
					t.Fatalf("%s: no subscription", c.Name)
				}
				// The queue policy lets SNS send, for this topic only.
				allowed := false
				for _, qp := range tpl.resources("AWS::SQS::QueuePolicy") {
					if len(list(qp.Props["Queues"])) != 1 || refID(list(qp.Props["Queues"])[0]) != dlq.ID {
						continue
					}
					for _, st := range list(dig(qp.Props, "PolicyDocument", "Statement")) {
						if dig(st, "Effect") == "Allow" && dig(st, "Principal", "Service") == "sns.amazonaws.com" && dig(st, "Action") == "sqs:SendMessage" &&
							refID(dig(st, "Condition", "ArnEquals", "aws:SourceArn")) == topic {
							allowed = true
						}
					}
				}
				if !allowed {
					t.Errorf("%s: no queue policy lets the topic's SNS send to %s", c.Name, c.SubscriptionDLQName())
				}
				// Its key lets SNS encrypt for this topic.
				key := tpl.resource(refID(dlq.Props["KmsMasterKeyId"]))
				snsMayUse := false
				for _, st := range list(dig(key.Props, "KeyPolicy", "Statement")) {
					acts := fmt.Sprint(dig(st, "Action"))
					if dig(st, "Effect") == "Allow" && dig(st, "Principal", "Service") == "sns.amazonaws.com" &&
						strings.Contains(acts, "kms:GenerateDataKey") && strings.Contains(acts, "kms:Decrypt") &&
						refID(dig(st, "Condition", "ArnEquals", "aws:SourceArn")) == topic {
						snsMayUse = true
					}
				}
				if !snsMayUse {
					t.Errorf("%s: the key of %s does not let the topic's SNS encrypt to it", c.Name, c.SubscriptionDLQName())
				}
			}
		})
	}
}

// The operations function can drain both DLQs of every consumer into the
// consumer's queue, and FIFOBOX_QUEUES tells it where they are.
func TestRedriveReachesEveryDeadLetterQueue(t *testing.T) {
	tpl := awsStacks(t).stateless
	fns := functions(t, tpl)
	role := refID(fns["redrive"].Props["Role"])
	sts := statements(tpl)
	can := map[string]map[string]bool{} // action -> queue logical ids
	for _, p := range tpl.resources("AWS::IAM::Policy") {
		attached := false
		for _, r := range list(p.Props["Roles"]) {
			attached = attached || refID(r) == role
		}
		if !attached {
			continue
		}
		for _, st := range sts[p.ID] {
			for _, a := range list(st["Action"]) {
				for _, r := range list(st["Resource"]) {
					if can[a.(string)] == nil {
						can[a.(string)] = map[string]bool{}
					}
					can[a.(string)][refID(r)] = true
				}
			}
		}
	}
	var queues map[string]map[string]string
	if err := json.Unmarshal([]byte(joinTemplate(dig(fns["redrive"].Props, "Environment", "Variables", "FIFOBOX_QUEUES"))), &queues); err != nil {
		t.Fatal(err)
	}
	for _, c := range topology.Default().Consumers {
		for _, name := range []string{c.DLQName(), c.SubscriptionDLQName()} {
			id := queueByName(t, tpl, name).ID
			for _, a := range []string{"sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:ChangeMessageVisibility"} {
				if !can[a][id] {
					t.Errorf("redrive role cannot %s on %s", a, name)
				}
			}
			if can["sqs:SendMessage"][id] {
				t.Errorf("redrive role can send to %s: it should only drain it", name)
			}
		}
		if !can["sqs:SendMessage"][queueByName(t, tpl, c.QueueName()).ID] {
			t.Errorf("redrive role cannot send to %s", c.QueueName())
		}
		if got, want := queues[c.Name]["subscription_dlq_url"], "<ref:"+queueByName(t, tpl, c.SubscriptionDLQName()).ID+">"; got != want {
			t.Errorf("FIFOBOX_QUEUES[%s].subscription_dlq_url = %q, want %s", c.Name, got, want)
		}
	}
}

// Every log group keeps a year of events, encrypted with a rotated key of
// its stack that CloudWatch Logs may use for this account's log groups only.
func TestLogGroupsEncryptedAndKeptAYear(t *testing.T) {
	s := awsStacks(t)
	for variant, tpl := range map[string]template{"stateful": s.stateful, "stateless": s.stateless, "local": localStack(t)} {
		groups := tpl.resources("AWS::Logs::LogGroup")
		if len(groups) == 0 {
			t.Errorf("%s: no log groups", variant)
		}
		for _, g := range groups {
			if num(g.Props["RetentionInDays"]) != 365 {
				t.Errorf("%s %s: RetentionInDays %v, want 365", variant, g.ID, g.Props["RetentionInDays"])
			}
			key := tpl.resource(refID(g.Props["KmsKeyId"]))
			if key.Type != "AWS::KMS::Key" || key.Props["EnableKeyRotation"] != true {
				t.Errorf("%s %s: KmsKeyId %v is not a rotated key of the stack", variant, g.ID, g.Props["KmsKeyId"])
				continue
			}
			ok := false
			for _, st := range list(dig(key.Props, "KeyPolicy", "Statement")) {
				b, _ := json.Marshal(st)
				if dig(st, "Effect") == "Allow" && strings.Contains(string(b), `"logs.`) &&
					strings.Contains(string(b), "kms:EncryptionContext:aws:logs:arn") && strings.Contains(string(b), ":log-group:*") {
					ok = true
				}
			}
			if !ok {
				t.Errorf("%s %s: its key does not let CloudWatch Logs use it for this account's log groups", variant, g.ID)
			}
		}
	}
}

// No key lets anyone but an AWS service create grants on it (CT.KMS.PR.3).
func TestKeysDenyGrantsExceptForAWSServices(t *testing.T) {
	s := awsStacks(t)
	for variant, tpl := range map[string]template{"stateful": s.stateful, "stateless": s.stateless, "local": localStack(t)} {
		for _, k := range tpl.resources("AWS::KMS::Key") {
			ok := false
			for _, st := range list(dig(k.Props, "KeyPolicy", "Statement")) {
				c := dig(st, "Condition", "BoolIfExists")
				if dig(st, "Effect") == "Deny" && dig(st, "Action") == "kms:CreateGrant" && dig(st, "Principal", "AWS") == "*" &&
					dig(c, "kms:GrantIsForAWSResource") == "false" && dig(c, "aws:PrincipalIsAWSService") == "false" {
					ok = true
				}
			}
			if !ok {
				t.Errorf("%s key %s: no statement denying kms:CreateGrant to all but AWS services", variant, k.ID)
			}
		}
	}
}

func TestDatabaseEnhancedMonitoring(t *testing.T) {
	tpl := awsStacks(t).stateful
	for _, i := range tpl.resources("AWS::RDS::DBInstance") {
		if num(i.Props["MonitoringInterval"]) != 60 || i.Props["MonitoringRoleArn"] == nil {
			t.Errorf("instance %s: MonitoringInterval %v role %v, want enhanced monitoring every 60 s", i.ID, i.Props["MonitoringInterval"], i.Props["MonitoringRoleArn"])
		}
	}
}

// cfnGuard returns the cfn-guard binary and AWS Control Tower's rules that
// npm's @cdklabs/cdk-validator-cfnguard ships (pinned in .tools, installed
// by infra/scripts/test.sh).
func cfnGuard(t *testing.T) (bin, rules string) {
	t.Helper()
	dir := os.Getenv("FIFOBOX_CFN_GUARD_DIR")
	if dir == "" {
		dir = "../../.tools/node_modules/@cdklabs/cdk-validator-cfnguard"
	}
	osDir := map[string]string{"linux": "ubuntu", "darwin": "macos"}[runtime.GOOS]
	arch := map[string]string{"amd64": "x86_64", "arm64": "aarch64"}[runtime.GOARCH]
	bin = filepath.Join(dir, "bin", osDir, arch, "cfn-guard")
	rules = filepath.Join(dir, "rules", "control-tower", "cfn-guard")
	if _, err := os.Stat(bin); err != nil {
		if os.Getenv("FIFOBOX_REQUIRE_GUARD") == "1" {
			t.Fatalf("cfn-guard not found at %s (FIFOBOX_REQUIRE_GUARD=1): npm ci --prefix .tools", bin)
		}
		t.Skipf("cfn-guard not installed (%s): ./infra/scripts/test.sh installs it", bin)
	}
	return bin, rules
}

// AWS Control Tower's proactive controls, run with cfn-guard over every
// template: each finding is either fixed or suppressed on that resource
// with a written reason (stacks.GuardMetadataKey), and no suppression
// outlives its finding.
func TestControlTowerGuardRules(t *testing.T) {
	bin, rules := cfnGuard(t)
	s := awsStacks(t)
	tpls := map[string]template{"Fifobox-Stateful": s.stateful, "Fifobox-Stateless": s.stateless, "Fifobox-Local": localStack(t)}
	for variant := range brokerSynths {
		b := brokerStacks(t, variant)
		tpls[variant+"-Fifobox-Stateful"] = b.stateful
		tpls[variant+"-Fifobox-Stateless"] = b.stateless
	}
	dir := t.TempDir()
	args := []string{"validate", "-r", rules, "--structured", "-S", "none", "-o", "json"}
	for name, tpl := range tpls {
		b, err := json.Marshal(tpl)
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, name+".template.json")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		args = append(args, "-d", p)
	}
	cmd := exec.Command(bin, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, runErr := cmd.Output() // exits non-zero when any rule fails
	var docs []struct {
		Name         string `json:"name"`
		NotCompliant []struct {
			Rule struct {
				Name string `json:"name"`
			} `json:"Rule"`
		} `json:"not_compliant"`
		Compliant []string `json:"compliant"`
	}
	if err := json.Unmarshal(out, &docs); err != nil {
		t.Fatalf("cfn-guard output (%v): %v\n%s\n%s", runErr, err, out, stderr.String())
	}
	var raw []map[string]any
	_ = json.Unmarshal(out, &raw)
	resourceRef := regexp.MustCompile(`/Resources/([A-Za-z0-9]+)`)
	used := map[string]bool{} // template/resource/rule
	findings, passed := 0, 0
	for i, doc := range docs {
		name := strings.TrimSuffix(filepath.Base(doc.Name), ".template.json")
		tpl := tpls[name]
		passed += len(doc.Compliant)
		for j, nc := range doc.NotCompliant {
			b, _ := json.Marshal(dig(raw[i], "not_compliant").([]any)[j])
			ids := map[string]bool{}
			for _, m := range resourceRef.FindAllStringSubmatch(string(b), -1) {
				ids[m[1]] = true
			}
			if len(ids) == 0 {
				t.Errorf("%s: rule %s fails on no particular resource: %s", name, nc.Rule.Name, b)
			}
			for _, id := range keys(ids) {
				findings++
				reason, ok := guardSuppression(tpl, id, nc.Rule.Name)
				switch {
				case !ok:
					t.Errorf("%s: %s fails on %s (%s): fix it, or suppress it with suppressGuard and the reason", name, nc.Rule.Name, id, tpl.resource(id).Type)
				case len(reason) < 40:
					t.Errorf("%s: %s on %s suppressed without a real reason: %q", name, nc.Rule.Name, id, reason)
				default:
					used[name+"/"+id+"/"+nc.Rule.Name] = true
					if testing.Verbose() {
						t.Logf("suppressed %s on %s %s: %s", nc.Rule.Name, name, id, reason)
					}
				}
			}
		}
	}
	for name, tpl := range tpls {
		for _, r := range tpl.resources("") {
			for _, x := range list(dig(r.Meta, stacks.GuardMetadataKey, "rules_to_suppress")) {
				if rule, _ := dig(x, "id").(string); rule != "" && !used[name+"/"+r.ID+"/"+rule] {
					t.Errorf("%s: %s is suppressed on %s but does not fail there: remove the suppression", name, rule, r.ID)
				}
			}
		}
	}
	t.Logf("cfn-guard: %d rule passes, %d findings on resources (any without a suppression is reported above)", passed, findings)
	if passed == 0 {
		t.Errorf("no Control Tower rule passed on any template: are the rules loaded?")
	}
}

func guardSuppression(tpl template, id, rule string) (string, bool) {
	r, _ := tpl["Resources"].(map[string]any)[id].(map[string]any)
	for _, x := range list(dig(r, "Metadata", stacks.GuardMetadataKey, "rules_to_suppress")) {
		if dig(x, "id") == rule {
			reason, _ := dig(x, "reason").(string)
			return reason, true
		}
	}
	return "", false
}
