package stacks

import (
	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsiam"
	"github.com/aws/aws-cdk-go/awscdk/v2/awskms"
	"github.com/aws/constructs-go/constructs/v10"
	"github.com/aws/jsii-runtime-go"
)

// AWS Control Tower's proactive controls (cfn-guard rules, run over the
// synthesised templates by TestControlTowerGuardRules) have no suppression
// mechanism of their own. A finding that is not fixed is suppressed here,
// one rule on one resource with the reason, in the resource's metadata in
// the shape cdk-nag uses: {"cfn_guard": {"rules_to_suppress": [{"id", "reason"}]}}.
// The test fails on a finding without a suppression, on a suppression
// without a reason, and on a suppression whose rule no longer fails.

// GuardMetadataKey is the metadata key of cfn-guard suppressions.
const GuardMetadataKey = "cfn_guard"

// suppressGuard records that rule may fail on c (a CfnResource or an L2
// construct whose default child is one), and why.
func suppressGuard(c constructs.IConstruct, rule, reason string) {
	cfn, ok := c.(awscdk.CfnResource)
	if !ok {
		cfn, ok = c.Node().DefaultChild().(awscdk.CfnResource)
	}
	if !ok {
		panic("suppressGuard: " + *c.Node().Path() + " has no CloudFormation resource")
	}
	var list []any
	if m, ok := cfn.GetMetadata(jsii.String(GuardMetadataKey)).(map[string]any); ok {
		list, _ = m["rules_to_suppress"].([]any)
	}
	list = append(list, map[string]any{"id": rule, "reason": reason})
	cfn.AddMetadata(jsii.String(GuardMetadataKey), map[string]any{"rules_to_suppress": list})
}

// suppressGuardAt is suppressGuard for a construct the CDK library creates
// (a singleton provider function), found by its path below the stack.
func suppressGuardAt(stack awscdk.Stack, path []string, rule, reason string) {
	var c constructs.IConstruct = stack
	for _, id := range path {
		c = c.Node().TryFindChild(jsii.String(id))
		if c == nil {
			panic("suppressGuardAt: no " + id + " in " + *stack.StackName())
		}
	}
	suppressGuard(c, rule, reason)
}

// The reason shared by CDK's own deploy-time provider functions.
const providerOutsideVpc = "CDK's deploy-time custom-resource provider: it runs only during a deployment, calls AWS APIs and answers CloudFormation's pre-signed S3 response URL; the VPC's subnets are isolated (no NAT, no S3 or Lambda endpoint), so inside it the provider could not respond. It holds no data."

// denyGrantsToNonServices adds the key policy statement Control Tower's
// CT.KMS.PR.3 asks for: nobody may create a grant on the key unless the
// grant is for an AWS resource created by an AWS service on the caller's
// behalf. fifobox itself creates no grants (SNS, SQS and CloudWatch Logs use
// the key through their service principals and the key policy).
func denyGrantsToNonServices(key awskms.Key) {
	key.AddToResourcePolicy(awsiam.NewPolicyStatement(&awsiam.PolicyStatementProps{
		Sid:        jsii.String("DenyGrantsExceptForAWSServices"),
		Effect:     awsiam.Effect_DENY,
		Principals: &[]awsiam.IPrincipal{awsiam.NewAnyPrincipal()},
		Actions:    jsii.Strings("kms:CreateGrant"),
		Resources:  jsii.Strings("*"),
		Conditions: &map[string]any{"BoolIfExists": map[string]any{
			"kms:GrantIsForAWSResource": "false",
			"aws:PrincipalIsAWSService": "false",
		}},
	}), nil)
}

// newLogsKey is a customer-managed key for a stack's log groups: CloudWatch
// Logs in this region may use it only for this account's log groups (the
// key policy CloudWatch Logs documents, with the encryption-context
// condition).
func newLogsKey(stack awscdk.Stack, alias, description string) awskms.Key {
	key := awskms.NewKey(stack, jsii.String("LogsKey"), &awskms.KeyProps{
		Description:       jsii.String(description),
		EnableKeyRotation: jsii.Bool(true),
		Alias:             jsii.String(alias),
	})
	key.AddToResourcePolicy(awsiam.NewPolicyStatement(&awsiam.PolicyStatementProps{
		Sid:        jsii.String("CloudWatchLogsUseForThisAccountsLogGroups"),
		Principals: &[]awsiam.IPrincipal{awsiam.NewServicePrincipal(jsii.String("logs."+*stack.Region()+".amazonaws.com"), nil)},
		Actions: jsii.Strings("kms:Encrypt", "kms:Decrypt", "kms:ReEncryptFrom", "kms:ReEncryptTo",
			"kms:GenerateDataKey", "kms:GenerateDataKeyWithoutPlaintext", "kms:DescribeKey"),
		Resources: jsii.Strings("*"),
		Conditions: &map[string]any{"ArnLike": map[string]any{
			"kms:EncryptionContext:aws:logs:arn": "arn:" + *stack.Partition() + ":logs:" + *stack.Region() + ":" + *stack.Account() + ":log-group:*",
		}},
	}), nil)
	denyGrantsToNonServices(key)
	return key
}
